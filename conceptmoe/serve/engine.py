"""The continuous-batching engine: one scheduler thread owns the model (CONCEPTMOE.md §4).

Requests (token ids in, token ids out) are submitted from any thread; the scheduler runs, in a
loop: drop cancelled rows -> admit waiting requests that the KV pool (``pool.py``) can hold,
prefilled together and joined to the running batch (``batch.py``) -> one cached decode step of
every running row (``inference/steps.py``: rows differ in length, concept count and, for an
elastic model, ratio) -> sample each row with its own settings and generator -> rows that
finished leave the batch and free their blocks. Each request's ``emit`` callback receives an
``Event`` per new token, called from the scheduler thread; the HTTP side never touches tensors.

Memory: the K/V entries live in block storage (``paged.py``): the budget is allocated once as
pages, and the pool (``pool.py``) gives each request blocks of pages, a token block before the
step that writes it, a concept block in the step whose token starts a concept. Admission,
headroom and preemption follow ``policy.py``.

Isolation: a prefill that raises ends the requests of that prefill, a decode step that raises
ends the rows of that step (each with an ``error`` event) and a row whose logits are not finite
or whose sampling raises ends alone; waiting requests and the engine go on.

Boundaries: the boundary of a token is decided when the token is fed to the model, i.e. one step
after it was sampled; each event carries the boundaries decided in that step (completion token
indices). The last token of a finished request is never fed, so its boundary stays undecided.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from typing import Callable

import torch

from ..inference.steps import decode_step
from .batch import cat_states, select_state
from .paged import PageStore, PoolExhausted
from .policy import MemoryPolicy
from .prefill import ChunkedPrefill
from .pool import KVLayout, KVPool, expected_concepts
from .request import Event, Refused, Request
from .sampling import sample_row

__all__ = ["Engine", "Event", "Refused", "Request"]


class Engine(MemoryPolicy, ChunkedPrefill):
    """Continuous batching over one model; see the module docstring."""

    def __init__(self, model, kv_bytes: int, max_batch: int = 32, max_waiting: int = 256,
                 max_model_len: int = 2048, eos: list[int] | None = None,
                 on_finish: Callable[[Request], None] | None = None, max_prefill_tokens: int = 2048) -> None:
        self.eos = list(eos or [])  # the run's end-of-text ids: a request that samples one stops
        self.model = model.eval()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.layout = lay = KVLayout.of(model, self.dtype)
        pages = kv_bytes // lay.page_bytes  # the whole budget, allocated once as pages (``paged.py``)
        self.pool = KVPool(lay, pages * lay.page_bytes)  # (refuses a budget that holds no sequence)
        self.pool.store = PageStore(pages, model.cfg.n_kv_heads, model.cfg.head_dim, lay.block, self.dtype,
                                    self.device)
        self.concept = model.cfg.is_concept
        self.design_ratio = model.cfg.compression_ratio if self.concept else None
        self.elastic = self.concept and model.cfg.elastic_ratios is not None
        self.max_batch, self.max_waiting, self.max_model_len = max_batch, max_waiting, max_model_len
        self.on_finish = on_finish
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.state = None
        self.cv = threading.Condition()
        self.accepting, self.stopped = True, False
        self.admit_blocked = False  # a prefilled request did not fit: wait for blocks to be freed
        self.admit_one = False  # a prefill ran out of blocks: the next one takes one request
        self.admitting: list[Request] = []  # taken from the queue this loop (answered even if a bug strikes)
        self.max_prefill_tokens = max_prefill_tokens  # tokens a step may prefill (``prefill.py``)
        self.cohort: list[Request] = []  # admitted, being prefilled chunk by chunk
        self.cstate, self.clogits = None, {}
        self.steps = self.peak_running = self.refused = 0
        self.peak_tensor_bytes = 0  # most K/V tensor bytes the running batch's caches held at once
        self.thread = threading.Thread(target=self._loop, name="conceptmoe-engine", daemon=True)

    # --- the HTTP side ---------------------------------------------------------------------------
    def start(self) -> "Engine":
        self.thread.start()
        return self

    def submit(self, req: Request) -> None:
        """Queue ``req``; ``Refused`` if it can never fit or the queue is full."""
        total = len(req.prompt) + req.max_tokens
        if total > self.max_model_len:
            self.refused += 1
            raise Refused(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) = {total} exceeds "
                          f"the server's max_model_len of {self.max_model_len}", 400)
        need = self._estimate(req, total + 1)
        if need > self.pool.budget:
            self.refused += 1
            raise Refused(f"this request needs about {need / 2**20:.2f} MiB of KV cache, more than the server's "
                          f"whole pool ({self.pool.budget / 2**20:.2f} MiB, --kv-cache-mb)", 400)
        if req.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.seed)
        with self.cv:
            if not self.accepting:
                self.refused += 1
                raise Refused("the server is shutting down", 503)
            if len(self.waiting) >= self.max_waiting:
                self.refused += 1
                raise Refused(f"the server is busy: {len(self.waiting)} requests already wait "
                              f"(--max-waiting); retry later", 503)
            self.waiting.append(req)
            self.cv.notify()

    def cancel(self, req: Request) -> None:
        """Stop ``req`` (client gone, stop string met): its row leaves at the next step."""
        with self.cv:
            req.cancelled = True
            self.cv.notify()

    def shutdown(self, grace: float) -> None:
        """Take no more requests; let running ones finish for ``grace`` seconds, then cancel the rest."""
        with self.cv:
            self.accepting = False
            self.cv.notify()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.running or self.waiting or self.cohort):
            time.sleep(0.02)
        with self.cv:
            for r in list(self.waiting) + self.running + self.cohort:
                r.cancelled = True
            self.stopped = True
            self.cv.notify()
        self.thread.join(timeout=30)

    def snapshot(self) -> dict:
        with self.cv:
            return {"running": len(self.running) + len(self.cohort), "prefilling": len(self.cohort),
                    "waiting": len(self.waiting), "peak_running": self.peak_running,
                    "refused": self.refused, "steps": self.steps, "kv_tensor_bytes": self._tensor_bytes(),
                    "kv_workspace_bytes": self.pool.store.workspace_bytes(),
                    "peak_kv_tensor_bytes": self.peak_tensor_bytes, **self.pool.stats()}

    # --- the scheduler thread ----------------------------------------------------------------------
    def _ratio(self, req: Request) -> float | None:
        return None if not self.concept else (req.ratio or self.design_ratio)

    def _estimate(self, req: Request, tokens: int) -> int:
        """Pool bytes of ``req`` at ``tokens`` tokens, its concepts expected at its ratio."""
        return self.layout.bytes_for(tokens, expected_concepts(tokens, self._ratio(req)))

    @staticmethod
    def _boundary(req: Request) -> None:
        """The last generated token (just fed) starts a concept."""
        req.boundary_list.append(len(req.generated) - 1)
        req.decided.append(len(req.generated) - 1)

    def _tensor_bytes(self) -> int:
        """Bytes of the K/V tensors the server holds (allocated, not the ledger): the page store."""
        return self.pool.store.bytes_allocated()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not (self.waiting or self.running or self.cohort or self.stopped):
                    self.cv.wait()
                if self.stopped and not self.running and not self.waiting and not self.cohort:
                    return
            try:
                self._drop_cancelled()
                self._admit()
                if self.running:
                    self._decode()
            except Exception as e:  # a bug outside the model's steps: fail the rows it touched, keep serving
                traceback.print_exc()
                self._fail_running(e)
                self._drop_cohort()
                with self.cv:
                    lost = [r for r in self.admitting if r.finish_reason is None and r not in self.waiting]
                for r in lost:  # taken from the queue, never joined: they must hear too
                    self._finish(r, "error", f"{type(e).__name__}: {e}")
            self.admitting = []

    @staticmethod
    def _emit(req: Request, ev: Event) -> None:
        """Hand ``ev`` to the client; a client that cannot take it (its event loop closed) is gone."""
        try:
            req.emit(ev)
        except Exception:  # noqa: BLE001 - the scheduler thread must outlive any one client
            req.cancelled = True

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.finished = reason, time.perf_counter()
        self.pool.free(req.id)
        self.admit_blocked = False
        self._emit(req, Event([], finish_reason=reason, error=error))
        if self.on_finish is not None:
            self.on_finish(req)

    def _fail_running(self, e: Exception) -> None:
        """A step failed: every row in it ends with an error; waiting requests are untouched."""
        for r in self.running:
            self._finish(r, "error", f"{type(e).__name__}: {e}")
        self.running, self.state = [], None

    def _keep(self, keep: list[int]) -> None:
        """Keep only the running rows at indices ``keep``."""
        self.running = [self.running[i] for i in keep]
        self.state = select_state(self.state, keep) if keep else None

    def _remove(self, gone: list[Request]) -> None:
        ids = {r.id for r in gone}
        self._keep([i for i, r in enumerate(self.running) if r.id not in ids])

    def _drop_cancelled(self) -> None:
        with self.cv:
            gone = [r for r in self.waiting if r.cancelled]
            for r in gone:
                self.waiting.remove(r)
        for r in gone + self._drop_cancelled_cohort():
            self._finish(r, "cancelled")
        dead = [r for r in self.running if r.cancelled]
        if dead:
            for r in dead:
                self._finish(r, "cancelled")
            self._remove(dead)

    def _admit(self) -> None:
        """Admit a cohort when none is being prefilled; feed the cohort one chunk (``prefill.py``)."""
        if not self.cohort and not self.admit_blocked:
            new: list[Request] = []
            with self.cv:
                free = self.pool.free_bytes - (self._reserve() if self.running else 0)
                while self.waiting and len(self.running) + len(new) < self.max_batch and not (self.admit_one and new):
                    r = self.waiting[0]
                    need = self._estimate(r, r.seen + 1)
                    if need > free:
                        break  # first come, first served: no overtaking
                    free -= need
                    new.append(self.waiting.popleft())
            for r in new:
                r.fed = 0
            self.cohort, self.cstate, self.admit_one = new, None, self.admit_one and not new
        if not self.cohort:
            return
        self.admitting = list(self.cohort)
        try:
            got = self._feed_cohort()
        except PoolExhausted:  # its prompts cut more concepts than admission expected
            rows = self._drop_cohort()
            if self.running or len(rows) > 1:  # wait for rows to leave, or try the first one alone
                with self.cv:
                    self.waiting.extendleft(reversed(rows))
                self.admit_blocked, self.admit_one = bool(self.running), True
            else:
                self._finish(rows[0], "error", f"the prompt needs more KV cache than the whole pool "
                                               f"({self.pool.budget / 2**20:.2f} MiB, --kv-cache-mb)")
            return
        except Exception as e:  # noqa: BLE001 - the rows of this prefill end, nothing else does
            traceback.print_exc()
            for r in self._drop_cohort():
                self._finish(r, "error", f"the prefill failed: {type(e).__name__}: {e}")
            return
        if got is None:
            return
        new, logits, state = got
        kept, back = [], []
        for i, r in enumerate(new):
            r.concepts = len(state.boundaries[i]) if self.concept else 0
            # +1 token entry: the sampled token is written by the next step
            (kept if self.pool.grow(r.id, r.seen + 1, r.concepts) else back).append(i)
        if back and not self.running and not kept:
            # Alone, with the whole pool free, and still too big (its text cut more concepts than
            # the admission estimate): it can never run.
            for i in back:
                self._finish(new[i], "error", f"the prompt needs more KV cache than the whole pool "
                                              f"({self.pool.budget / 2**20:.2f} MiB, --kv-cache-mb)")
            back = []
        with self.cv:
            for i in reversed(back):
                self.waiting.appendleft(new[i])
        self.admit_blocked = bool(back)  # no new prefill until a row leaves and frees blocks
        if not kept:
            return
        if back:
            logits, state = logits[kept], select_state(state, kept)
        admitted = [new[i] for i in kept]
        for r, b in zip(admitted, state.boundaries):
            r.admitted_step = self.steps
            if not r.generated:
                r.prompt_concepts = len(b)
            elif self.concept and (r.seen - 1) in b:  # a recomputed row: its last token's pending decision
                self._boundary(r)
        self.running += admitted
        self.state = state if self.state is None else cat_states([self.state, state])
        self.peak_running = max(self.peak_running, len(self.running))
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, self._tensor_bytes())
        self._sample_and_emit(logits, admitted, offset=len(self.running) - len(admitted))

    def _decode(self) -> None:
        self._make_room()
        if not self.running:
            return
        fed = torch.tensor([r.generated[-1] for r in self.running], device=self.device)
        try:
            out = decode_step(self.model, self.state, fed)
        except Exception as e:  # noqa: BLE001 - the rows of this step end, waiting requests do not
            traceback.print_exc()
            self._fail_running(e)
            return
        self.steps += 1
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, self._tensor_bytes())
        full = [r for r in self.running if r.id in self.state.tokens.overflowed
                or (self.state.concepts is not None and r.id in self.state.concepts.overflowed)]
        for r in self.running:
            r.fed += 1
        if out.boundary is not None:
            for r, b in zip(self.running, out.boundary.tolist()):
                if b:
                    r.concepts += 1
                    self._boundary(r)
                    if not self.pool.grow(r.id, r.seen, r.concepts) and r not in full:
                        full.append(r)  # only a lone row steps without headroom (``_make_room``)
        self._sample_and_emit(out.logits, self.running, offset=0, out_of_memory=full)

    def _sample_and_emit(self, logits: torch.Tensor, rows: list[Request], offset: int,
                         out_of_memory: list[Request] = ()) -> None:
        """Sample one token for each of ``rows`` (running rows offset..offset+n), emit, retire finished rows.
        A row whose logits are not finite, or whose sampling raises, ends alone with an error."""
        greedy = logits.float().argmax(-1).tolist()
        finite = torch.isfinite(logits).all(-1).tolist()
        done: list[tuple[Request, str, str | None]] = []
        for i, r in enumerate(rows):
            first = {}
            if r.first_token is None:
                r.first_token = time.perf_counter()
                if r.prompt_lp is not None:
                    first = {"prompt_logprobs": r.prompt_lp}
            decided, r.decided = r.decided, []
            if r.max_tokens == 0:
                self._emit(r, Event([], decided, **first))
                done.append((r, "length", None))
                continue
            if any(x is r for x in out_of_memory):
                self._emit(r, Event([], decided, **first))
                done.append((r, "length", None))
                continue
            try:
                if not finite[i]:
                    raise FloatingPointError("the model's logits for this request are not finite")
                tok, lp = sample_row(r, logits[i], greedy[i])
            except Exception as e:  # noqa: BLE001 - this request ends, the batch goes on
                done.append((r, "error", f"sampling failed: {type(e).__name__}: {e}"))
                continue
            if tok in r.eos or tok in r.stop_token_ids:
                self._emit(r, Event([], decided, **first))
                done.append((r, "stop", None))
                continue
            r.generated.append(tok)
            self._emit(r, Event([tok], decided, logprobs=None if lp is None else [lp], **first))
            if len(r.generated) >= r.max_tokens:
                done.append((r, "length", None))
        if done:
            for r, reason, error in done:
                self._finish(r, reason, error)
            self._remove([r for r, _, _ in done])

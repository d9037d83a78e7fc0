"""The continuous-batching engine: one scheduler thread owns the model (CONCEPTMOE.md §4).

Requests (token ids in, token ids out) are submitted from any thread; the scheduler runs, in a
loop: drop cancelled rows -> admit waiting requests that the KV pool (``pool.py``) can hold,
prefilled together and joined to the running batch (``batch.py``) -> one cached decode step of
every running row (``inference/steps.py``: rows differ in length, concept count and, for an
elastic model, ratio) -> sample each row with its own settings and generator -> rows that
finished leave the batch and free their blocks. Each request's ``emit`` callback receives an
``Event`` per new token, called from the scheduler thread; the HTTP side never touches tensors.

Memory: a row's next token block is taken before the step that writes it, and a concept block
only after a step in which the row hit a boundary; before each step the pool must have room for
one concept block for every row whose concept blocks are full. When it has not, the most
recently admitted row is preempted (its blocks freed, its prompt plus the tokens it has produced
requeued at the front, recomputed by the next prefill), as vLLM does by default.

Boundaries: the boundary of a token is decided when the token is fed to the model, i.e. one step
after it was sampled; each event carries the boundaries decided in that step (completion token
indices). The last token of a finished request is never fed, so its boundary stays undecided.
"""

from __future__ import annotations

import itertools
import threading
import traceback
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..inference.generate import sample
from ..inference.steps import decode_step, prefill
from .batch import cat_states, select_state
from .pool import KVLayout, KVPool, expected_concepts


class Refused(Exception):
    """The request cannot be taken: ``status`` 503 (busy, come back) or 400 (can never fit)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Event:
    tokens: list[int]  # new completion tokens (empty on the last event of a cancelled request)
    boundaries: list[int] = field(default_factory=list)  # completion indices whose boundary was decided: yes
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    emit: Callable[[Event], None]
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    eos: list[int] = field(default_factory=list)
    ratio: float | None = None  # an elastic run's R for this request (None: its design ratio)
    id: int = field(default_factory=itertools.count().__next__)
    # Owned by the engine:
    generated: list[int] = field(default_factory=list)
    boundary_list: list[int] = field(default_factory=list)  # completion indices that start a concept
    decided: list[int] = field(default_factory=list)  # boundaries decided since the last event
    fed: int = 0  # tokens fed to the model (prompt + generated tokens already stepped)
    prompt_concepts: int = 0
    concepts: int = 0  # concept entries held in the cache
    cancelled: bool = False
    finish_reason: str | None = None
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    generator: torch.Generator | None = None

    @property
    def seen(self) -> int:
        """Tokens the cache holds once the last sampled token is fed (prompt + generated)."""
        return len(self.prompt) + len(self.generated)


class Engine:
    """Continuous batching over one model; see the module docstring."""

    def __init__(self, model, kv_bytes: int, max_batch: int = 32, max_waiting: int = 256,
                 max_model_len: int = 2048, eos: list[int] | None = None,
                 on_finish: Callable[[Request], None] | None = None) -> None:
        self.eos = list(eos or [])  # the run's end-of-text ids: a request that samples one stops
        self.model = model.eval()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.layout = KVLayout.of(model, self.dtype)
        self.pool = KVPool(self.layout, kv_bytes)
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
        self.steps = self.peak_running = self.refused = 0
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
        while time.monotonic() < deadline and (self.running or self.waiting):
            time.sleep(0.02)
        with self.cv:
            for r in list(self.waiting) + self.running:
                r.cancelled = True
            self.stopped = True
            self.cv.notify()
        self.thread.join(timeout=30)

    def snapshot(self) -> dict:
        with self.cv:
            return {"running": len(self.running), "waiting": len(self.waiting), "peak_running": self.peak_running,
                    "refused": self.refused, "steps": self.steps, **self.pool.stats()}

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

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not (self.waiting or self.running or self.stopped):
                    self.cv.wait()
                if self.stopped and not self.running and not self.waiting:
                    return
            try:
                self._drop_cancelled()
                self._admit()
                if self.running:
                    self._decode()
            except Exception as e:  # a bug must not hang every client: fail the batch, keep serving
                traceback.print_exc()
                for r in self.running:
                    self._finish(r, "error", f"{type(e).__name__}: {e}")
                self.running, self.state = [], None
                self.pool = KVPool(self.layout, self.pool.budget)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.finished = reason, time.perf_counter()
        self.pool.free(req.id)
        self.admit_blocked = False
        req.emit(Event([], finish_reason=reason, error=error))
        if self.on_finish is not None:
            self.on_finish(req)

    def _keep(self, keep: list[int]) -> None:
        """Keep only the running rows at indices ``keep``."""
        self.running = [self.running[i] for i in keep]
        self.state = select_state(self.state, keep) if keep else None

    def _drop_cancelled(self) -> None:
        with self.cv:
            gone = [r for r in self.waiting if r.cancelled]
            for r in gone:
                self.waiting.remove(r)
        for r in gone:
            self._finish(r, "cancelled")
        dead = [i for i, r in enumerate(self.running) if r.cancelled]
        if dead:
            for i in dead:
                self._finish(self.running[i], "cancelled")
            self._keep([i for i in range(len(self.running)) if i not in dead])

    def _admit(self) -> None:
        if self.admit_blocked:
            return
        new: list[Request] = []
        with self.cv:
            free = self.pool.free_bytes
            while self.waiting and len(self.running) + len(new) < self.max_batch:
                r = self.waiting[0]
                need = self._estimate(r, r.seen + 1)
                if need > free:
                    break  # first come, first served: no overtaking
                free -= need
                new.append(self.waiting.popleft())
        if not new:
            return
        seqs = [r.prompt + r.generated for r in new]
        lens = torch.tensor([len(s) for s in seqs], device=self.device)
        ids = torch.zeros(len(seqs), int(lens.max()), dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, device=self.device)
        ratio = None
        if self.elastic:
            ratio = torch.tensor([self._ratio(r) for r in new], device=self.device)
        out, state = prefill(self.model, ids, lens, ratio=ratio)
        kept, back = [], []
        for i, r in enumerate(new):
            r.concepts = len(state.boundaries[i]) if self.concept else 0
            r.fed = len(seqs[i])
            # +1 token entry: the sampled token is written by the next step
            (kept if self.pool.grow(r.id, len(seqs[i]) + 1, r.concepts) else back).append(i)
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
            out.logits, state = out.logits[kept], select_state(state, kept)
        admitted = [new[i] for i in kept]
        for r, b in zip(admitted, state.boundaries):
            if not r.generated:
                r.prompt_concepts = len(b)
            elif self.concept and (r.seen - 1) in b:  # a recomputed row: its last token's pending decision
                self._boundary(r)
        self.running += admitted
        self.state = state if self.state is None else cat_states([self.state, state])
        self.peak_running = max(self.peak_running, len(self.running))
        self._sample_and_emit(out.logits, admitted, offset=len(self.running) - len(admitted))

    def _preempt_one(self, protect: int | None = None) -> bool:
        """Preempt the most recently admitted row (never ``protect``); False if none can go."""
        victims = [i for i in range(len(self.running)) if i != protect]
        if not victims:
            return False
        i = victims[-1]
        r = self.running[i]
        self.pool.free(r.id)
        self.admit_blocked = False
        r.preemptions += 1
        with self.cv:
            self.waiting.appendleft(r)
        self._keep([j for j in range(len(self.running)) if j != i])
        return True

    def _make_room(self) -> None:
        """Before a step: every row's next token block, and room for a concept block per full row."""
        for r in list(self.running):
            while r in self.running and not self.pool.grow(r.id, r.seen, r.concepts):
                i = self.running.index(r)
                if not self._preempt_one(protect=i):  # alone and out of memory: it ends here
                    self._finish(r, "length")
                    self._keep([j for j in range(len(self.running)) if j != i])
        lay = self.layout
        while self.running and lay.concept_entry_bytes:
            full = sum(1 for r in self.running if r.concepts % lay.block == 0)
            if full * lay.concept_block_bytes <= self.pool.free_bytes:
                break
            if not self._preempt_one():
                break

    def _decode(self) -> None:
        self._make_room()
        if not self.running:
            return
        fed = torch.tensor([r.generated[-1] for r in self.running], device=self.device)
        out = decode_step(self.model, self.state, fed)
        self.steps += 1
        for r in self.running:
            r.fed += 1
        if out.boundary is not None:
            for r, b in zip(self.running, out.boundary.tolist()):
                if b:
                    r.concepts += 1
                    self._boundary(r)
                    if not self.pool.grow(r.id, r.seen, r.concepts):
                        raise RuntimeError("KV pool overdrawn after a boundary (headroom check failed)")
        self._sample_and_emit(out.logits, self.running, offset=0)

    def _sample_and_emit(self, logits: torch.Tensor, rows: list[Request], offset: int) -> None:
        """Sample one token for each of ``rows`` (running rows offset..offset+n), emit, retire finished rows."""
        greedy = logits.float().argmax(-1).tolist()
        done = []
        for i, r in enumerate(rows):
            if r.temperature == 0:
                tok = greedy[i]
            else:
                tok = int(sample(logits[i:i + 1], r.temperature, r.top_k, r.top_p, r.generator)[0])
            decided, r.decided = r.decided, []
            if r.first_token is None:
                r.first_token = time.perf_counter()
            if tok in r.eos:
                r.emit(Event([], decided))
                done.append((offset + i, "stop"))
                continue
            r.generated.append(tok)
            r.emit(Event([tok], decided))
            if len(r.generated) >= r.max_tokens:
                done.append((offset + i, "length"))
        if done:
            for i, reason in done:
                self._finish(self.running[i], reason)
            gone = {i for i, _ in done}
            self._keep([j for j in range(len(self.running)) if j not in gone])

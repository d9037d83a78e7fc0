"""Chunked prefill for the engine: a per-step token budget, so one long prompt does not stall the streams.

``ChunkedPrefill`` is mixed into ``Engine`` (``engine.py``). The requests admitted together form a
*cohort*, prefilled into block storage (``paged.py``) over as many engine steps as it takes: each
step feeds the cohort at most ``max_prefill_tokens`` tokens (less the running rows' one token
each, as vLLM counts its per-step budget), shared first come, first served — the first chunk by
``prefill``, the next ones by ``extend`` (``inference/extend.py``) — and then the running rows
take their decode step as usual. A cohort row whose prompt (plus, for a preempted row, the
tokens it had produced) is all fed leaves the cohort and joins the running batch at once; the
next cohort is admitted when this one is done. A request that asks for its prompt's
log-probabilities is fed whole in its first chunk (they come from one pass).
"""

from __future__ import annotations

import torch

from ..inference.extend import extend
from ..inference.steps import prefill
from .batch import select_state
from .paged import PagedKVCache
from .request import Request
from .sampling import prompt_logprobs


class ChunkedPrefill:
    """Mixed into ``Engine``: ``cohort`` (rows being prefilled, in order), ``cstate`` (their state once
    their first chunk is fed) and ``clogits`` (each row's logits after its last fed token)."""

    def _chunk_sizes(self, rows: list[Request], first: bool) -> list[int]:
        budget = max(self.max_prefill_tokens - len(self.running), 1)
        sizes = []
        for r in rows:
            rest = r.seen - r.fed
            whole = r.prompt_logprobs is not None and r.prompt_lp is None
            k = rest if whole else min(rest, max(budget, 1 if first else 0))
            sizes.append(k)
            budget -= k
        return sizes

    def _feed_cohort(self) -> tuple[list[Request], torch.Tensor, object] | None:
        """Feed the cohort one chunk; (rows now complete, their logits (n, V), their state) or None."""
        rows, first = self.cohort, self.cstate is None
        sizes = self._chunk_sizes(rows, first)
        chunks = [(r.prompt + r.generated)[r.fed:r.fed + k] for r, k in zip(rows, sizes)]
        ids = torch.zeros(len(rows), max(1, max(sizes)), dtype=torch.long, device=self.device)
        for i, c in enumerate(chunks):
            if c:
                ids[i, :len(c)] = torch.tensor(c, device=self.device)
        n = torch.tensor(sizes, device=self.device)
        if first:
            ratio = torch.tensor([self._ratio(r) for r in rows], device=self.device) if self.elastic else None
            want = [i for i, r in enumerate(rows) if r.prompt_logprobs is not None and r.prompt_lp is None]
            seq_ids = [r.id for r in rows]
            make = lambda kind, *_: PagedKVCache(self.pool, 0 if kind == "token" else 1, seq_ids)  # noqa: E731
            out, self.cstate = prefill(self.model, ids, n, ratio=ratio, keep_hidden=bool(want), make_cache=make)
            with torch.no_grad():
                for i in want:
                    r = rows[i]
                    r.prompt_lp = prompt_logprobs(self.model, out.hidden[i, :len(r.prompt)], r.prompt,
                                                  r.prompt_logprobs)
            out.hidden = None
        else:
            out = extend(self.model, self.cstate, ids, n)
        for i, (r, k) in enumerate(zip(rows, sizes)):
            if k:
                r.fed += k
                self.clogits[r.id] = out.logits[i]
        done = [i for i, r in enumerate(rows) if r.fed == r.seen]
        if not done:
            return None
        rest = [i for i in range(len(rows)) if i not in done]
        state = select_state(self.cstate, done)
        logits = torch.stack([self.clogits.pop(rows[i].id) for i in done])
        complete = [rows[i] for i in done]
        self.cohort = [rows[i] for i in rest]
        self.cstate = select_state(self.cstate, rest) if rest else None
        return complete, logits, state

    def _drop_cohort(self) -> list[Request]:
        """Forget the cohort (its pages freed, its progress reset); the rows it held."""
        rows = self.cohort
        for r in rows:
            self.pool.free(r.id)
            r.fed = 0
            self.clogits.pop(r.id, None)
        self.cohort, self.cstate = [], None
        return rows

    def _drop_cancelled_cohort(self) -> list[Request]:
        dead = [i for i, r in enumerate(self.cohort) if r.cancelled]
        if not dead:
            return []
        gone = [self.cohort[i] for i in dead]
        keep = [i for i in range(len(self.cohort)) if i not in dead]
        if self.cstate is not None:
            self.cstate = select_state(self.cstate, keep) if keep else None
        self.cohort = [self.cohort[i] for i in keep]
        for r in gone:
            self.clogits.pop(r.id, None)
        return gone

"""The engine's memory policy: admission headroom, the preemption victim, room before a step.

``MemoryPolicy`` is mixed into ``Engine`` (``engine.py``) and reads its running rows, queue and
KV pool (``pool.py``). Before each step every running row gets its next token block and the pool
must have a free concept block for every row whose concept blocks are full (a boundary in the
step takes one). When it has not, the row that arrived last is preempted, as vLLM does: its
blocks are freed and it is requeued at the front with the tokens it produced, recomputed by the
next prefill. Three rules keep that from thrashing: admission leaves the running rows' next
blocks free (a newly admitted row does not push a running one out, nor get pushed out at once);
a row re-admitted since the last step is the victim only if no other row can go; and a lone row
is never preempted for headroom: recomputing it frees nothing it could use, so it steps on and
ends ("length") only if it then starts a concept the pool cannot hold.
"""

from __future__ import annotations

from .request import Request


class MemoryPolicy:
    """Mixed into ``Engine``: uses its ``running``, ``waiting``, ``pool``, ``layout`` and ``steps``."""

    def _reserve(self) -> int:
        """Pool bytes the running rows may take at the next step: their next token block, and a
        concept block for each row whose concept blocks are full. Admission leaves them free, so a
        newly admitted row does not push a running one out (and get itself preempted in turn)."""
        lay, need = self.layout, 0
        for r in self.running:
            held = self.pool.held.get(r.id, [0, 0])
            need += max(0, lay.blocks(r.seen) - held[0]) * lay.token_block_bytes
            if lay.concept_entry_bytes and r.concepts % lay.block == 0:
                need += lay.concept_block_bytes
        return need

    def _victim(self, protect: Request | None = None) -> Request | None:
        """The row to preempt: the latest arrival (vLLM's first-come-first-served priority), never
        ``protect``, and a row re-admitted since the last step only if no other row can go."""
        rows = [r for r in self.running if r is not protect]
        settled = [r for r in rows if not (r.preemptions and r.admitted_step >= self.steps)]
        pool = settled or rows
        return max(pool, key=lambda r: (r.arrival, r.id)) if pool else None

    def _preempt(self, r: Request) -> None:
        self.pool.free(r.id)
        self.admit_blocked = False
        r.preemptions += 1
        r.fed = 0  # recomputed from the start by the next prefill
        with self.cv:
            self.waiting.appendleft(r)
        self._remove([r])

    def _make_room(self) -> None:
        """Before a step: every row's next token block, and room for a concept block per full row."""
        for r in list(self.running):
            while r in self.running and not self.pool.grow(r.id, r.seen, r.concepts):
                v = self._victim(protect=r)
                if v is None:  # alone and out of memory: it ends here
                    self._finish(r, "length")
                    self._remove([r])
                else:
                    self._preempt(v)
        lay = self.layout  # a lone row is never preempted for headroom (module docstring)
        while len(self.running) > 1 and lay.concept_entry_bytes:
            full = sum(1 for r in self.running if r.concepts % lay.block == 0)
            if full * lay.concept_block_bytes <= self.pool.free_bytes:
                break
            self._preempt(self._victim())

"""A fix for vLLM 0.32's CPU engine: seeded sampling of a prompt split across steps.

When a step prefills only part of a prompt, vLLM samples a token for the request anyway, throws
it away, and rewinds the request's generator so the discarded draw leaves no trace:
``gen.set_offset(gen.get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync``, the Philox
offset of a CUDA generator. A CPU generator (Mersenne Twister) has no offset, so every seeded
request with temperature > 0 whose prompt is split fails the whole engine ("CPU Generator does
not use offset"), the MoE export's as much as a ConceptMoE's.

Here the rewind is done the CPU way: the generator state of each row whose sample will be
discarded is saved before sampling and put back after it, and during the bookkeeping that would
rewind by offset those rows see a stand-in whose offset calls do nothing. CUDA generators are
left to vLLM. Applied by ``register`` only where the bug is: on the vLLM versions the plugin
accepts (``TESTED_VLLM``), on CPU, and only while a CPU generator has no offset (``needed``).
"""

from __future__ import annotations

import numpy as np


class _Restored:
    """Stands in for a generator already rewound by state: vLLM's offset rewind does nothing."""

    @staticmethod
    def get_offset() -> int:
        return 0

    @staticmethod
    def set_offset(offset: int) -> None:
        pass


def needed() -> bool:
    """Whether this torch's CPU generators lack the offset vLLM rewinds (the bug's cause)."""
    import torch

    try:
        torch.Generator().get_offset()
    except RuntimeError:
        return True
    return False


def patch() -> None:
    """Wrap the model runner's ``_sample`` and ``_bookkeeping_sync`` (idempotent; nothing where
    the bug is absent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_conceptmoe_seeded", False) or not needed():
        return
    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        n = self.input_batch.num_reqs
        saved = {}
        for i in np.nonzero(self.discard_request_mask.np[:n])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None and gen.device.type == "cpu":
                saved[int(i)] = (gen, gen.get_state())
        out = sample(self, *args, **kwargs)
        for gen, state in saved.values():
            gen.set_state(state)
        self._conceptmoe_restored = saved
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        saved, gens = getattr(self, "_conceptmoe_restored", {}), self.input_batch.generators
        for i in saved:
            gens[i] = _Restored
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            for i, (gen, _) in saved.items():
                gens[i] = gen
            self._conceptmoe_restored = {}

    GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    GPUModelRunner._conceptmoe_seeded = True

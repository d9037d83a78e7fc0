"""The KV budget bounds real memory: block storage allocated once, rows joining and leaving by id.

Under a load that binds, the K/V tensors the engine holds are the page store's and never more
than ``--kv-cache-mb``; no cache tensor is made per batch (no copy when a row joins or leaves);
and in the same bytes a ConceptMoE holds more sequences than a MoE of the same depth, because its
concept blocks fill about R times slower. Greedy output under this load equals ``model.generate``
(``test_serve_engine.py``, which runs on the same storage).
"""

from __future__ import annotations

import threading

import torch
from test_serve_engine import _model, _prompts, _serve

from conceptmoe.serve.engine import Engine, Request
from conceptmoe.serve.paged import PagedKVCache
from conceptmoe.serve.pool import KVLayout


def _tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``'s attributes (dataclasses, lists, dicts)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple, set)):
        return [t for x in obj for t in _tensors(x, seen)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x, seen)]
    if hasattr(obj, "__dict__"):
        return [t for x in vars(obj).values() for t in _tensors(x, seen)]
    return []


def test_kv_tensors_never_exceed_the_budget_under_a_binding_load():
    for kind in ("conceptmoe", "moe"):
        m = _model(kind)
        budget = 3 * KVLayout.of(m, torch.float32).bytes_for(48, 24)
        eng = Engine(m, budget, max_batch=8, max_model_len=256)
        store = eng.pool.store
        ptr, readings, done = store.k.data_ptr(), [], threading.Semaphore(0)

        def emit(ev):  # on the scheduler thread, between steps
            s = eng.state
            if s is not None:
                kinds = {type(c) for c in (s.tokens, s.concepts) if c is not None}
                known = {store.k.data_ptr(), store.v.data_ptr(), store.work_k.data_ptr(), store.work_v.data_ptr()}
                outside = [t for c in (s.tokens, s.concepts) if c is not None for t in _tensors(vars(c))
                           if t.data_ptr() not in known and t is not getattr(c, "_table", None)]
                work = store.workspace_bytes()
                readings.append((eng.pool.used_bytes, store.bytes_allocated(), kinds, len(outside), len(eng.running),
                                 work))
            if ev.finish_reason:
                done.release()
        prompts = _prompts(12, seed=5)
        for i, p in enumerate(prompts):
            eng.submit(Request(p, 16 + i, emit=emit, temperature=0))
        eng.start()
        for _ in prompts:
            assert done.acquire(timeout=120), "a request never finished"
        assert max(r[4] for r in readings) > 1 and eng.pool.peak_bytes > budget - 2 * eng.layout.token_block_bytes
        assert sum(eng.snapshot()[k] for k in ("token_blocks_used", "concept_blocks_used")) == 0
        assert store.bytes_allocated() <= budget and store.k.data_ptr() == ptr
        assert all(r[2] == {PagedKVCache} for r in readings), "a dense cache came back"
        assert all(r[1] == store.bytes_allocated() for r in readings)  # allocated once, never more
        assert all(r[3] == 0 for r in readings), "a cache holds K/V tensors outside the page store"
        # the keys and values of the one layer a step attends with, gathered into a reused buffer:
        # rows x the longest row's blocks of one layer, a transient of the step beside the budget
        assert 0 < max(r[5] for r in readings) < budget
        assert max(r[0] for r in readings) <= budget and eng.snapshot()["peak_kv_tensor_bytes"] <= budget
        assert len(store.free) * eng.layout.page_bytes == store.bytes_allocated()  # every page back
        eng.shutdown(1)


def test_the_same_bytes_hold_more_conceptmoe_sequences():
    cm, moe = _model("conceptmoe"), _model("moe")
    lc, lm = KVLayout.of(cm, torch.float32), KVLayout.of(moe, torch.float32)
    assert lc.page_bytes == lm.page_bytes and lc.n_token_layers + lc.n_concept_layers == lm.n_token_layers
    budget = 6 * lm.bytes_for(64, 0)
    reqs = [dict(prompt=p, max_tokens=40, temperature=0) for p in _prompts(16, seed=9)]
    peaks = {}
    for name, m in (("cm", cm), ("moe", moe)):
        eng = Engine(m, budget, max_batch=16, max_model_len=256).start()
        _serve(eng, reqs)
        peaks[name] = eng.peak_running
        assert eng.snapshot()["peak_kv_tensor_bytes"] <= budget
        eng.shutdown(1)
    assert peaks["cm"] > peaks["moe"], peaks

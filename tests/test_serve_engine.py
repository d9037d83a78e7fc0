"""The serving engine without HTTP: continuous batching equals ``model.generate`` row by row.

Requests of different lengths (and ratios, for an elastic model) join and leave one running batch;
a KV budget that binds makes some wait and others be preempted and recomputed. Greedy output of
every request must still equal what ``model.generate`` gives for that prompt alone (fp32), seeded
sampling must not depend on the rest of the batch, and every block must be free at the end.
"""

from __future__ import annotations

import threading

import pytest
import torch
from method_helpers import trained_like

from conceptmoe import ModelConfig, build_model
from conceptmoe.serve.engine import Engine, Refused, Request
from conceptmoe.serve.pool import KVLayout, KVPool

RATIOS = [1.5, 2.0, 3.0]


def _model(kind: str):
    if kind == "moe":
        torch.manual_seed(1)
        m = build_model(ModelConfig.from_preset("tiny", kind="moe"))
        with torch.no_grad():
            m.lm_head.weight.normal_(std=0.5)  # decisive logits: greedy ties would test rounding, not batching
        return m.eval()
    if kind == "elastic":
        return trained_like(0, elastic_ratios=RATIOS, ratio_embedding="router+concept").eval()
    return trained_like(0).eval()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _serve(engine: Engine, reqs: list[dict], timeout: float = 120) -> list[Request]:
    """Submit every request at once; wait until all finished; the engine's requests."""
    done = threading.Semaphore(0)
    out = []
    for kw in reqs:
        tokens: list[int] = []

        def emit(ev, tokens=tokens):
            tokens.extend(ev.tokens)
            if ev.finish_reason:
                done.release()
        r = Request(emit=emit, **kw)
        r.streamed = tokens
        out.append(r)
    for r in out:
        engine.submit(r)
    for _ in out:
        assert done.acquire(timeout=timeout), "a request never finished"
    return out


@pytest.mark.parametrize("kind", ["conceptmoe", "moe", "elastic"])
@pytest.mark.parametrize("budget", ["roomy", "binding"])
def test_greedy_batched_equals_generate_alone(kind, budget):
    m = _model(kind)
    lay = KVLayout.of(m, torch.float32)
    # binding: about three sequences' worth of blocks, so requests wait and rows get preempted
    kv = 2**22 if budget == "roomy" else 3 * lay.bytes_for(48, 24)
    eng = Engine(m, kv, max_batch=6, max_model_len=256).start()
    prompts = _prompts(10)
    ratios = [RATIOS[i % 3] if i % 4 else None for i in range(10)] if kind == "elastic" else [None] * 10
    reqs = [dict(prompt=p, max_tokens=8 + 2 * i, temperature=0, ratio=ratios[i]) for i, p in enumerate(prompts)]
    served = _serve(eng, reqs)
    for r, kw in zip(served, reqs):
        extra = {"ratio": kw["ratio"]} if kw["ratio"] else {}
        ref = m.generate(torch.tensor([kw["prompt"]]), kw["max_tokens"], temperature=0, **extra)[0, len(kw["prompt"]):]
        assert r.streamed == ref.tolist(), f"request {r.id} (ratio {kw['ratio']}, preempted {r.preemptions}x)"
        assert r.finish_reason == "length"
    snap = eng.snapshot()
    assert snap["token_blocks_used"] == snap["concept_blocks_used"] == snap["sequences"] == 0
    if budget == "binding":
        assert sum(r.preemptions for r in served) > 0, "no row was preempted: the budget did not bind"
    eng.shutdown(1)


def test_seeded_sampling_does_not_depend_on_the_batch():
    m = _model("conceptmoe")
    prompt = _prompts(1, seed=3)[0]
    kw = dict(prompt=prompt, max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone = _serve(Engine(m, 2**22).start(), [kw])[0].streamed
    others = [dict(prompt=p, max_tokens=10, temperature=1.0, seed=i) for i, p in enumerate(_prompts(5, seed=4))]
    crowded = _serve(Engine(m, 2**22, max_batch=3).start(), others[:2] + [kw] + others[2:])[2].streamed
    assert alone == crowded
    g = torch.Generator().manual_seed(1234)
    ref = m.generate(torch.tensor([prompt]), 12, temperature=0.9, top_k=50, top_p=0.95, generator=g)[0, len(prompt):]
    assert alone == ref.tolist()


def test_concept_blocks_follow_boundaries_and_hold_more_sequences():
    cm = _model("conceptmoe")
    events = []
    eng = Engine(cm, 2**22).start()

    def snoop(ev):
        r = eng.running[0] if eng.running else None
        if r is not None and ev.finish_reason is None:  # (a finished row has freed its blocks)
            events.append((r.concepts, eng.pool.held.get(r.id, [0, 0])[1], r.seen))
    r = Request(_prompts(1, 7)[0], 40, temperature=0, emit=snoop)
    _serve_one = threading.Event()
    r.emit = lambda ev: (snoop(ev), ev.finish_reason and _serve_one.set())
    eng.submit(r)
    assert _serve_one.wait(60)
    bs = eng.layout.block
    assert events and all(held == -(-c // bs) for c, held, _ in events), "concept blocks not taken at boundaries"
    assert 1 < events[-1][2] / events[-1][0], "the router never merged tokens"
    # Same layers at the token rate: a MoE of the same depth holds fewer sequences in one budget.
    moe_lay = KVLayout(cm.cfg.n_layers * eng.layout.token_entry_bytes // (cm.cfg.n_encoder_layers + cm.cfg.n_decoder_layers), 0)
    budget, n, c = 40 * moe_lay.bytes_for(64, 0), 64, events[-1][0] * 64 // events[-1][2] + 1
    assert budget // eng.layout.bytes_for(n, c) > budget // moe_lay.bytes_for(n, 0)


def test_refusals():
    m = _model("conceptmoe")
    eng = Engine(m, 4 * KVLayout.of(m, torch.float32).bytes_for(32, 32), max_batch=1, max_waiting=1, max_model_len=64)
    with pytest.raises(Refused, match="max_model_len") as e:
        eng.submit(Request([1] * 60, 10, emit=lambda ev: None))
    assert e.value.status == 400
    small = Engine(m, KVLayout.of(m, torch.float32).bytes_for(16, 16), max_model_len=256)
    with pytest.raises(Refused, match="whole pool"):
        small.submit(Request([1] * 10, 100, emit=lambda ev: None))
    eng.submit(Request([1, 2, 3], 5, emit=lambda ev: None))  # not started: it waits
    with pytest.raises(Refused, match="busy") as e:
        eng.submit(Request([1, 2, 3], 5, emit=lambda ev: None))
    assert e.value.status == 503
    with pytest.raises(ValueError, match="holds no sequence"):
        KVPool(KVLayout(1024, 1024), 100)


def test_a_prompt_that_cuts_more_concepts_than_expected_never_hangs_the_engine():
    """Every token a boundary (compression 1 at R = 2): admitted on the R = 2 estimate, too big
    once prefilled, alone with the whole pool: it ends with an error; the engine keeps serving."""
    m = _model("conceptmoe")
    m.route = lambda h, terms, offset=0: torch.ones(h.shape[:2])  # p = 1: every prompt token a concept
    lay = KVLayout.of(m, torch.float32)
    eng = Engine(m, lay.bytes_for(62, 31), max_model_len=256).start()
    out = _serve(eng, [dict(prompt=list(range(1, 61)), max_tokens=1, temperature=0)], timeout=30)[0]
    assert out.finish_reason == "error"
    ok = _serve(eng, [dict(prompt=[1, 2, 3], max_tokens=3, temperature=0)], timeout=30)[0]
    assert ok.finish_reason == "length" and len(ok.streamed) == 3
    eng.shutdown(1)

"""Chunked prefill in the engine: a per-step token budget, and streams that go on meanwhile.

With a budget of a few tokens per step, every prompt is prefilled over several steps (``prefill``
then ``extend`` into block storage); greedy output must still equal ``model.generate`` under a
binding pool (rows preempted and recomputed chunk by chunk), and a running stream must keep
receiving tokens while a long prompt is prefilled.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_serve_engine import RATIOS, _model, _prompts, _serve

from conceptmoe.serve.engine import Engine, Request
from conceptmoe.serve.pool import KVLayout


def _ref(m, prompt, n, ratio=None):
    extra = {"ratio": ratio} if ratio else {}
    return m.generate(torch.tensor([prompt]), n, temperature=0, **extra)[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["conceptmoe", "moe", "elastic"])
def test_chunked_prefill_equals_generate_under_a_binding_pool(kind):
    m = _model(kind)
    lay = KVLayout.of(m, torch.float32)
    eng = Engine(m, 3 * lay.bytes_for(48, 24), max_batch=6, max_model_len=256, max_prefill_tokens=7).start()
    prompts = _prompts(10, seed=21)
    ratios = [RATIOS[i % 3] if i % 4 else None for i in range(10)] if kind == "elastic" else [None] * 10
    reqs = [dict(prompt=p, max_tokens=8 + 2 * i, temperature=0, ratio=ratios[i]) for i, p in enumerate(prompts)]
    served = _serve(eng, reqs)
    for r, kw in zip(served, reqs):
        assert r.streamed == _ref(m, kw["prompt"], kw["max_tokens"], kw["ratio"]), f"request {r.id}"
    assert sum(r.preemptions for r in served) > 0, "the pool did not bind"
    snap = eng.snapshot()
    assert snap["sequences"] == snap["running"] == snap["prefilling"] == 0
    eng.shutdown(1)


def test_a_long_prompt_does_not_stall_a_running_stream():
    m = _model("moe")
    eng = Engine(m, 2**22, max_batch=4, max_model_len=512, max_prefill_tokens=8).start()
    short, = _prompts(1, seed=22)
    long = torch.randint(0, 256, (240,), generator=torch.Generator().manual_seed(23)).tolist()
    log, done = [], threading.Semaphore(0)
    b = Request(long, 4, emit=lambda ev: (log.append(("b", ev.tokens)), ev.finish_reason and done.release()),
                temperature=0)

    def emit_a(ev):
        log.append(("a", ev.tokens))
        if len(log) == 1:
            eng.submit(b)  # the long prompt arrives while A streams
        if ev.finish_reason:
            done.release()
    a = Request(short, 60, emit=emit_a, temperature=0)
    eng.submit(a)
    assert done.acquire(timeout=60) and done.acquire(timeout=60)
    first_b = next(i for i, (who, toks) in enumerate(log) if who == "b")
    during = sum(1 for who, toks in log[1:first_b] if who == "a" and toks)
    assert during >= 240 // 8 - 2, f"A got {during} tokens while B's 240-token prompt was prefilled"
    assert a.generated == _ref(m, short, 60) and b.generated == _ref(m, long, 4)
    eng.shutdown(1)

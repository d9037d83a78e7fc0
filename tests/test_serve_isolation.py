"""No request harms another: failures end only the requests they touch; preemption does not thrash.

Each failure is injected into the engine's own path (a row's sampling, a prefill, a decode step,
a client that cannot take its events) while an unrelated request is in flight or waiting; that
request must still equal ``model.generate`` token for token, nothing may be left waiting with no
answer, and the engine must keep serving.
"""

from __future__ import annotations

import threading

import torch
from test_serve_engine import _model, _prompts, _serve

import conceptmoe.serve.engine as engine_mod
import conceptmoe.serve.prefill as prefill_mod
from conceptmoe.serve.engine import Engine, Request
from conceptmoe.serve.pool import KVLayout

POISON = 251  # a prompt starting with this token makes the patched prefill raise


def _ref(m, prompt, n):
    return m.generate(torch.tensor([prompt]), n, temperature=0)[0, len(prompt):].tolist()


def _idle(eng: Engine) -> None:
    snap = eng.snapshot()
    assert snap["running"] == snap["waiting"] == snap["sequences"] == snap["token_blocks_used"] == 0, snap


def test_a_row_whose_sampling_overflows_ends_alone():
    m = _model("conceptmoe")
    eng = Engine(m, 2**22, max_batch=4).start()
    a, b = _prompts(2, seed=11)
    # temperature 1e-39 passes no HTTP validation, but the engine must survive it anyway
    served = _serve(eng, [dict(prompt=a, max_tokens=12, temperature=0),
                          dict(prompt=b, max_tokens=12, temperature=1e-39, seed=3)])
    assert served[1].finish_reason == "error" and served[1].streamed == []
    assert served[0].finish_reason == "length" and served[0].streamed == _ref(m, a, 12)
    _idle(eng)
    eng.shutdown(1)


def test_a_raising_prefill_ends_only_its_requests(monkeypatch):
    m = _model("conceptmoe")
    real = prefill_mod.prefill

    def prefill(model, ids, *a, **kw):
        if bool((ids[:, 0] == POISON).any()):
            raise RuntimeError("out of memory (injected)")
        return real(model, ids, *a, **kw)
    monkeypatch.setattr(prefill_mod, "prefill", prefill)
    eng = Engine(m, 2**22, max_batch=4).start()
    good, = _prompts(1, seed=12)
    bad_reqs, seen = [], threading.Event()
    done = threading.Semaphore(0)

    def bad_emit(ev):
        if ev.finish_reason:
            done.release()

    def good_emit(ev, toks=[]):  # noqa: B006 - the stream of the unrelated request
        toks.extend(ev.tokens)
        if not seen.is_set():  # once it runs, two poisoned requests arrive, prefilled together
            seen.set()
            for _ in range(2):
                bad_reqs.append(Request([POISON, 1, 2, 3], 5, emit=bad_emit, temperature=0))
                eng.submit(bad_reqs[-1])
        if ev.finish_reason:
            done.release()
    r = Request(good, 20, emit=good_emit, temperature=0)
    eng.submit(r)
    for _ in range(3):
        assert done.acquire(timeout=60), "a request was left with no answer"
    assert [x.finish_reason for x in bad_reqs] == ["error", "error"]
    assert r.finish_reason == "length" and good_emit.__defaults__[0] == _ref(m, good, 20)
    after = _serve(eng, [dict(prompt=[5, 6, 7], max_tokens=4, temperature=0)])[0]
    assert after.streamed == _ref(m, [5, 6, 7], 4)
    _idle(eng)
    eng.shutdown(1)


def test_a_raising_decode_step_ends_its_rows_and_the_waiting_request_completes(monkeypatch):
    m = _model("moe")
    real, calls = engine_mod.decode_step, []

    def decode_step(model, state, tokens):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(model, state, tokens)
    monkeypatch.setattr(engine_mod, "decode_step", decode_step)
    eng = Engine(m, 2**22, max_batch=1).start()  # one row at a time: the second request waits
    a, b = _prompts(2, seed=13)
    served = _serve(eng, [dict(prompt=a, max_tokens=10, temperature=0), dict(prompt=b, max_tokens=10, temperature=0)])
    assert served[0].finish_reason == "error" and len(served[0].streamed) == 3
    assert served[1].finish_reason == "length" and served[1].streamed == _ref(m, b, 10)
    _idle(eng)
    eng.shutdown(1)


def test_a_client_that_cannot_take_events_does_not_stop_the_engine():
    m = _model("moe")
    eng = Engine(m, 2**22, max_batch=4).start()

    def closed(ev):
        raise RuntimeError("Event loop is closed")
    eng.submit(Request([1, 2, 3], 50, emit=closed, temperature=0))
    a, = _prompts(1, seed=14)
    ok = _serve(eng, [dict(prompt=a, max_tokens=8, temperature=0)])[0]
    assert ok.streamed == _ref(m, a, 8)
    assert eng.thread.is_alive()
    eng.shutdown(1)


def test_a_lone_row_is_never_preempted_for_headroom():
    """Every token a boundary: the lone row outgrows its concept blocks; recomputing it would
    free nothing it could use, so it steps on and ends when the pool cannot hold a concept."""
    m = _model("conceptmoe")
    m.route = lambda h, terms, offset=0: torch.ones(h.shape[:2])  # p = 1: every token starts a concept
    m.chunk.step = lambda h, last_key, pos, **kw: (torch.ones(h.shape[0]), last_key)  # (decode steps too)
    lay = KVLayout.of(m, torch.float32)
    eng = Engine(m, lay.bytes_for(48, 32), max_model_len=256).start()
    prompt = list(range(1, 11))
    r = _serve(eng, [dict(prompt=prompt, max_tokens=30, temperature=0)], timeout=60)[0]
    assert r.preemptions == 0, f"a lone row was preempted {r.preemptions}x"
    assert r.finish_reason == "length" and 10 < len(r.streamed) < 30
    assert r.streamed == _ref(m, prompt, 30)[:len(r.streamed)]
    _idle(eng)
    eng.shutdown(1)


def test_the_victim_is_the_latest_arrival_but_not_a_row_just_readmitted():
    eng = Engine(_model("moe"), 2**22)
    old, readmitted, newer = (Request([1], 4, emit=lambda ev: None) for _ in range(3))
    old.arrival, newer.arrival, readmitted.arrival = 1.0, 2.0, 3.0
    readmitted.preemptions, readmitted.admitted_step = 1, eng.steps  # re-admitted since the last step
    eng.running = [old, readmitted, newer]
    assert eng._victim() is newer
    assert eng._victim(protect=newer) is old
    eng.running = [readmitted]
    assert eng._victim() is readmitted  # nothing else can go
    readmitted.admitted_step = eng.steps - 1
    eng.running = [old, readmitted, newer]
    assert eng._victim() is readmitted  # it has run a step since: the latest arrival again

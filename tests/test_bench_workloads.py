"""Issue 68 item 5: the loads people serve, as ``bench serve --engine vllm`` sends them.

Shared system prompts and multi-turn chat, sent to a stand-in for vLLM's OpenAI server on
127.0.0.1 (streams token ids, counts prefix-cache lookups on /metrics) that records every prompt:
each chat turn must resend the conversation so far (every earlier prompt and the tokens the
server generated for it) and be sent after the turn before it; each shared-prefix prompt is one of
the prefixes and a question of its own. vLLM itself serves these loads in the records
(docs/serving.md).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi.responses import PlainTextResponse, StreamingResponse  # noqa: E402

from conceptmoe.bench import vllm_serve  # noqa: E402
from conceptmoe.bench.serve import ServeBenchSettings  # noqa: E402
from conceptmoe.bench.workloads import chat_turns, shared_prefix_requests  # noqa: E402
from conceptmoe.errors import UserError  # noqa: E402
from vllm_helpers import free_port  # noqa: E402

HELD_OUT = list(range(3, 4000))


@pytest.fixture(scope="module")
def fake():
    app, seen = fastapi.FastAPI(), []

    @app.post("/v1/completions")
    async def complete(body: dict):
        seen.append((time.perf_counter(), body["prompt"]))
        n = body["max_tokens"]
        out = [(len(body["prompt"]) * 7 + i) % 50 + 1000 for i in range(n)]  # depends on the prompt

        def events():
            for t in out:
                yield "data: " + json.dumps({"choices": [{"token_ids": [t]}]}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        tokens = sum(len(p) for _, p in seen)
        return PlainTextResponse(f"vllm:prefix_cache_queries_total {tokens}\nvllm:prefix_cache_hits_total "
                                 f"{tokens // 2}\nvllm:num_preemptions_total 0\nvllm:num_requests_running 1\n")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(10)


def _settings(**kw) -> ServeBenchSettings:
    s = ServeBenchSettings(runs=["a"], requests=8, prompt_len=12, output_len=5, **kw)
    s.check()
    return s


def test_chat_turns_resend_the_conversation_with_its_answers(fake, monkeypatch):
    url, seen = fake
    monkeypatch.setattr(vllm_serve, "SETTLE_S", 0.0)
    s = _settings(workload="chat", turns=4)
    reqs = vllm_serve.load_requests(HELD_OUT, s)
    seen.clear()
    row = vllm_serve.measure(url, "x", reqs, s)
    assert row["requests"] == 8 and row["output_tokens"] == 8 * 5
    assert row["prefix_cache_hit_rate"] == pytest.approx(0.5, abs=0.01)
    prompts = [p for _, p in seen[1:]]  # after the warm-up
    for conv in (r["turns"] for r in reqs):
        history = []
        for k, new in enumerate(conv):
            want = history + new
            assert want in prompts, f"turn {k} was not sent as the conversation so far"
            answer = [(len(want) * 7 + i) % 50 + 1000 for i in range(5)]
            history = want + answer
        # sent in order: each turn after the one before it
        times = [next(t for t, p in seen[1:] if p == h) for h in _prefixes(conv)]
        assert times == sorted(times)


def _prefixes(conv):
    history, out = [], []
    for new in conv:
        out.append(history + new)
        history = out[-1] + [(len(out[-1]) * 7 + i) % 50 + 1000 for i in range(5)]
    return out


def test_shared_prefix_prompts_are_a_prefix_and_a_question():
    reqs = shared_prefix_requests(HELD_OUT, 12, 3, 100, 20, 8, seed=0)
    heads = {tuple(r["prompt"][:100]) for r in reqs}
    assert len(heads) == 3 and all(len(r["prompt"]) == 120 and r["max_tokens"] == 8 for r in reqs)
    assert len({tuple(r["prompt"][100:]) for r in reqs}) == 12  # every question its own
    assert sorted(sum(1 for r in reqs if tuple(r["prompt"][:100]) == h) for h in heads) == [4, 4, 4]
    assert [r["prefix"] for r in reqs] != sorted(r["prefix"] for r in reqs)  # sent in a seeded order
    assert reqs == shared_prefix_requests(HELD_OUT, 12, 3, 100, 20, 8, seed=0)


def test_bad_workloads_are_one_line_errors():
    with pytest.raises(UserError, match="--workload"):
        _settings(workload="burst")
    with pytest.raises(UserError, match="--prefixes"):
        shared_prefix_requests(HELD_OUT, 2, 3, 100, 20, 8, seed=0)
    with pytest.raises(UserError, match="--turns"):
        chat_turns(HELD_OUT, 2, 4, 10, seed=0)
    with pytest.raises(UserError, match="fewer than a piece"):
        shared_prefix_requests(HELD_OUT[:50], 6, 3, 100, 20, 8, seed=0)


def test_prefix_caching_is_vllms_default_for_both_models_and_off_for_both():
    assert _settings().prefix_caching == "on"
    assert vllm_serve.caching_args(_settings(prefix_caching="on")) == ""
    assert vllm_serve.caching_args(_settings(prefix_caching="off")) == " --no-enable-prefix-caching"

"""``conceptmoe serve`` over HTTP: the official ``openai`` client, curl, bad input, disconnects, load.

Every test talks to a live server on 127.0.0.1 (``serve_helpers.live_server``) over runs with
random, independent weights (``hf_helpers.concept_run``). Request counts and times are bounded.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess

import httpx
import pytest
import torch
from hf_helpers import concept_run
from openai import OpenAI
from serve_helpers import live_server, wait_idle

RATIOS = [1.5, 2.0, 3.0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-runs")
    models = {"cm": concept_run(root / "cm", seed=0, seq_len=128),
              "moe": concept_run(root / "moe", seed=1, kind="moe", seq_len=128),
              "elastic": concept_run(root / "elastic", seed=2, seq_len=128, elastic_ratios=RATIOS,
                                     ratio_embedding="router+concept")}
    return root, models


@pytest.fixture(scope="module")
def cm_server(runs):
    with live_server(runs[0] / "cm", kv_cache_mb=2, max_batch=16) as s:
        yield s


def _greedy(model, tok, prompt: str, n: int, **kw) -> tuple[list[int], str]:
    ids = tok.encode(prompt).ids
    new = model.generate(torch.tensor([ids]), n, temperature=0, **kw)[0, len(ids):].tolist()
    return new, tok.decode(new)


def _stream_events(url: str, body: dict) -> list[dict]:
    """The parsed SSE data of a streamed completion; asserts the [DONE] terminator."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_openai_client_plain_and_streamed_equal_generate(cm_server, runs):
    url, engine, tok = cm_server
    model = runs[1]["cm"]
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    assert name == "cm"
    prompt = "To be, or not to be"
    new, text = _greedy(model, tok, prompt, 20)
    c = client.completions.create(model=name, prompt=prompt, max_tokens=20, temperature=0)
    assert c.choices[0].text == text and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == len(tok.encode(prompt).ids) and c.usage.completion_tokens == 20
    ext = c.model_extra["conceptmoe"]
    assert ext["tokens_fed"] == c.usage.total_tokens - 1  # the last token is never fed
    assert ext["compression"] == pytest.approx(ext["tokens_fed"] / ext["concepts"], abs=1e-3)
    assert ext["kv_bytes"] < ext["kv_bytes_per_token_cache"]
    pieces = list(client.completions.create(model=name, prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == text
    streamed_bounds = [b for p in pieces for b in (p.model_extra.get("conceptmoe") or {}).get("boundaries", [])]
    assert streamed_bounds == ext["boundaries"] and streamed_bounds, "no concept boundary in 20 tokens"
    ids_from_tokens = client.completions.create(model=name, prompt=tok.encode(prompt).ids, max_tokens=20, temperature=0)
    assert ids_from_tokens.choices[0].text == text


def test_curl_streams_server_sent_events(cm_server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    url = cm_server[0]
    out = subprocess.run(["curl", "-sN", url + "/v1/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"prompt": "Hello", "max_tokens": 5, "stream": True, "seed": 1})],
                         capture_output=True, text=True, timeout=60).stdout
    events = [ln for ln in out.split("\n\n") if ln.strip()]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_string_and_seeded_sampling(cm_server, runs):
    url, _, tok = cm_server
    _, text = _greedy(runs[1]["cm"], tok, "The king", 30)
    stop = text[6:9]
    assert stop and stop in text
    r = httpx.post(url + "/v1/completions", json={"prompt": "The king", "max_tokens": 30, "temperature": 0,
                                                  "stop": [stop]}, timeout=60).json()
    assert r["choices"][0]["text"] == text[:text.index(stop)] and r["choices"][0]["finish_reason"] == "stop"
    streamed = _stream_events(url, {"prompt": "The king", "max_tokens": 30, "temperature": 0, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in streamed) == text[:text.index(stop)]
    body = {"prompt": "The king", "max_tokens": 15, "temperature": 1.0, "seed": 7}
    a, b = (httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] for _ in range(2))
    assert a == b


BAD = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ({"prompt": "x", "max_tokens": "5"}, "'max_tokens' must be an integer"),
    ({"prompt": "x", "max_tokens": 0}, ">= 1"),
    ({"prompt": "x", "max_tokens": -3}, ">= 1"),
    ({"prompt": "x", "max_tokens": 10**6}, "<= 128"),
    ({"prompt": "x", "temperature": math.nan}, "finite"),
    ({"prompt": "x", "temperature": math.inf}, "finite"),
    ({"prompt": "x", "temperature": "hot"}, "a number"),
    ({"prompt": "x", "top_p": 0}, "'top_p'"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({}, "'prompt' is required"),
    ({"prompt": [1, 2, 10**9]}, "outside the vocabulary"),
    ({"prompt": [1, -1]}, "outside the vocabulary"),
    ({"prompt": "x", "bogus": 1}, "unknown field"),
    ({"prompt": "x", "n": 99}, "'n' must be <= 16"),
    ({"prompt": "x", "temperature": 1e-39}, "overflow"),
    ({"prompt": "x", "repetition_penalty": 0}, "'repetition_penalty' must be >= 0.01"),
    ({"prompt": "x", "presence_penalty": 5}, "'presence_penalty' must be <= 2"),
    ({"prompt": "x", "logit_bias": {"5": 1e39}}, "'logit_bias' must be <= 100"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "not a token id"),
    ({"prompt": "x", "logprobs": 21}, "'logprobs' must be <= 20"),
    ({"prompt": "x", "logprobs": True}, "'logprobs' must be an integer"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "'min_tokens' must be <= 5"),
    ({"prompt": "x", "stop_token_ids": [10**9]}, "outside the vocabulary"),
    ({"prompt": "x", "best_of": 3}, "'best_of' is not supported"),
    ({"prompt": "x", "suffix": "y"}, "'suffix' is not supported"),
    ({"prompt": "x", "min_p": 0.1}, "'min_p' is not supported"),
    ({"prompt": "x", "stream": "yes"}, "'stream'"),
    ({"prompt": "x", "stop": [1]}, "'stop'"),
    ({"prompt": "x", "concept_ratio": 3}, "trained for R=2 only"),
    ({"prompt": "x " * 200, "max_tokens": 5}, "max_model_len"),
    # once a plain-text 500 each: integers past float (OverflowError), lone surrogates, deep nesting
    ({"prompt": "x", "max_tokens": 10**400}, "'max_tokens' is out of range: an integer of 401 digits"),
    ({"prompt": "x", "top_k": 10**400}, "'top_k' is out of range"),
    ({"prompt": "x", "seed": -(10**400)}, "'seed' is out of range"),
    ({"prompt": "x", "logit_bias": {"5": 10**400}}, "'logit_bias' is out of range"),
    ({"prompt": "x", "logit_bias": {"9" * 400: 1}}, "outside the vocabulary"),
    ({"prompt": "x", "concept_ratio": 10**400}, "'concept_ratio' is out of range"),
    ({"prompt": "x", "temperature": 10**400}, "'temperature' is out of range"),
    ({"prompt": "\ud800"}, "lone surrogate (\\ud800) in a string of 'prompt'"),
    ({"prompt": ["ok", "a\udfff"]}, "lone surrogate (\\udfff) in a string of 'prompt'"),
    ({"prompt": "x", "stop": "\ud800"}, "in a string of 'stop'"),
    ({"prompt": "x", "stop": ["ok", "\udbff"]}, "in a string of 'stop'"),
    ({"prompt": "x", "model": "\ud800"}, "in a string of 'model'"),
    ({"prompt": "x", "\ud800": 1}, "lone surrogate"),
    ("[" * 100_000, "nested too deeply"),
    ({"prompt": ["x"] * 64, "n": 16}, "more than the server ever queues"),
]


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-40])
def test_a_top_p_that_is_zero_in_fp32_samples_the_top_token(cm_server, runs, top_p):
    url, _, tok = cm_server
    _, text = _greedy(runs[1]["cm"], tok, "The king", 12)
    r = httpx.post(url + "/v1/completions", json={"prompt": "The king", "max_tokens": 12, "temperature": 1.0,
                                                  "top_p": top_p, "seed": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text  # nucleus of the top token alone: greedy


@pytest.mark.parametrize("body,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_a_400_and_the_server_is_unharmed(cm_server, body, message):
    url = cm_server[0]
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + "/v1/completions", content=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_unknown_model_route_and_method(cm_server):
    url = cm_server[0]
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/v1/nothing", timeout=5).status_code == 404
    assert httpx.get(url + "/v1/completions", timeout=5).status_code == 405


def test_client_gone_mid_stream_frees_its_blocks(cm_server):
    url, engine, _ = cm_server
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"prompt": "Once more", "max_tokens": 120, "stream": True, "temperature": 0}) as r:
        lines = r.iter_lines()
        assert next(ln for ln in lines if ln).startswith("data: ")
        assert engine.pool.held, "the request holds no blocks while streaming"
    h = wait_idle(url, timeout=5)
    assert h["running"] == 0 and h["token_blocks_used"] == 0 and h["concept_blocks_used"] == 0
    assert "cancelled" in httpx.get(url + "/metrics", timeout=5).text


def test_elastic_ratio_per_request(runs):
    root, models = runs
    with live_server(root / "elastic", kv_cache_mb=2) as (url, _, tok):
        prompt, got = "Now is the winter of our discontent", {}
        for R in (1.5, 3.0):
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "concept_ratio": R}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            assert r["choices"][0]["text"] == _greedy(models["elastic"], tok, prompt, 24, ratio=R)[1]
            got[R] = r["conceptmoe"]
            assert got[R]["concept_ratio"] == R
        assert got[3.0]["compression"] > got[1.5]["compression"]
        assert got[3.0]["kv_bytes"] < got[1.5]["kv_bytes"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "concept_ratio": 6}, timeout=30)
        assert r.status_code == 400 and "outside the trained range [1.5, 3]" in r.json()["error"]["message"]
        info = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["conceptmoe"]
        assert info["elastic_ratios"] == RATIOS
    with live_server(root / "moe", kv_cache_mb=2) as (url, _, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "concept_ratio": 2}, timeout=30)
        assert r.status_code == 400 and "plain MoE" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30).json()
        assert "boundaries" not in r["conceptmoe"] and r["usage"]["completion_tokens"] == 4


async def _client(http: httpx.AsyncClient, i: int) -> dict:
    body = {"prompt": f"Request {i}: " + "word " * (i % 13), "max_tokens": 1 + (i * 7) % 24,
            "temperature": 0.8, "seed": i, "stream": True}
    events, done, ids = [], False, set()
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done
            if line == "data: [DONE]":
                done = True
                continue
            e = json.loads(line[6:])
            ids.add(e["id"])
            events.append(e)
    assert done and len(ids) == 1
    final = events[-1]
    assert final["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    return {"id": ids.pop(), "max_tokens": body["max_tokens"], "usage": final["usage"]}


def test_64_concurrent_streaming_clients(runs):
    """Mixed lengths through a binding pool and a bounded batch: none lost, none duplicated, all freed."""
    with live_server(runs[0] / "cm", kv_cache_mb=0.25, max_batch=12, max_waiting=64) as (url, engine, _):
        async def load():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
                return await asyncio.wait_for(asyncio.gather(*(_client(http, i) for i in range(64))), 240)
        results = asyncio.run(load())
        assert len({r["id"] for r in results}) == 64
        assert all(r["usage"]["completion_tokens"] <= r["max_tokens"] for r in results)
        h = wait_idle(url)
        assert h["running"] == h["waiting"] == 0 and h["token_blocks_used"] == h["concept_blocks_used"] == 0
        assert h["peak_running"] <= 12
        metrics = httpx.get(url + "/metrics", timeout=5).text
        finished = sum(int(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith("conceptmoe_requests_finished_total{"))
        assert finished == 64
        for name in ("requests_running", "requests_waiting", "requests_refused_total", "prompt_tokens_total",
                     "generation_tokens_total", "kv_blocks_used{kind=\"concept\"}", "kv_blocks_free{kind=\"token\"}",
                     "compression_ratio", "kv_tensor_bytes", "kv_tensor_bytes_peak", "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_count"):
            assert f"conceptmoe_{name}" in metrics, name


def test_imported_and_converted_runs_are_served(tmp_path):
    """A transformers checkpoint brought in with import-hf, and its conversion to a ConceptMoE."""
    from test_interop import make_checkpoint, tokenizer

    from conceptmoe.cli import main
    from conceptmoe.training.checkpoint import load_run

    src = tmp_path / "qwen"
    make_checkpoint(src, "qwen2_moe")
    tokenizer(src / "tokenizer.json")
    assert main(["import-hf", str(src), "--out", str(tmp_path / "imported")]) == 0
    assert main(["convert", str(tmp_path / "imported"), "--out", str(tmp_path / "converted"), "--ratio", "2"]) == 0
    prompt = [5, 17, 250, 3, 99, 42, 7]
    for name in ("imported", "converted"):
        model = load_run(tmp_path / name, "cpu")[0]
        want = model.generate(torch.tensor([prompt]), 8, temperature=0)[0, len(prompt):].tolist()
        with live_server(tmp_path / name, kv_cache_mb=1, max_model_len=64) as (url, engine, tok):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
            assert r["usage"]["completion_tokens"] == 8
            assert r["choices"][0]["text"] == tok.decode(want), name
            assert ("boundaries" in r["conceptmoe"]) == (name == "converted")

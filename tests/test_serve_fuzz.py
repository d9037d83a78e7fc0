"""No request body makes ``conceptmoe serve`` answer 5xx: the OpenAPI schema fuzzed, then hostile JSON.

Two bounded, derandomized fuzzers post to one live server on 127.0.0.1 (an elastic ConceptMoE
with random, independent weights, ``--max-model-len 48``): schemathesis draws bodies from the
route's own schema in ``/openapi.json`` (``serve/openapi.py``), both valid ones and ones that break
it; hypothesis sets up to two fields (or unknown names) of otherwise plausible requests to any
JSON, the values that once gave a 500 drawn often (400-digit integers, lone surrogates, a top_p
that is 0 in fp32, deep nesting). Every answer must be below 500, every refusal OpenAI's error
JSON, every stream end with ``[DONE]``; afterwards the server is idle, holds no KV block and still
answers a greedy request with ``model.generate``'s tokens. Each fuzzer fails when one of those
500s is put back (checked by hand: the hostile one on each, the schema one on a top_k past the
vocabulary reaching ``topk``).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import requests
import torch
from hf_helpers import concept_run
from serve_helpers import live_server, wait_idle

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis import strategies as st  # noqa: E402

from conceptmoe.serve.protocol import KNOWN  # noqa: E402

SCHEMA_CASES, HOSTILE_CASES = 300, 400  # ~12 s and ~14 s on 2 idle CPU cores
FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-fuzz")
    model = concept_run(root / "el", seed=3, seq_len=64, elastic_ratios=[1.5, 2.0, 3.0],
                        ratio_embedding="router+concept")
    with live_server(root / "el", kv_cache_mb=2, max_batch=16, max_model_len=48) as (url, engine, tok):
        yield url, engine, tok, model


def _check(r, seen: list[int]) -> None:
    """No 5xx; a refusal is OpenAI's error JSON; a streamed answer ends with [DONE]. ``r``: an httpx
    or a requests response."""
    status, text = r.status_code, r.text
    seen.append(status)
    assert status < 500, f"{status}: {text[:500]}"
    if status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], text
    elif text.startswith("data: "):  # server-sent events
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-500:]
    else:
        assert json.loads(text)["choices"], text


def _healthy_afterwards(url: str, engine, tok, model) -> None:
    h = wait_idle(url, timeout=30)
    assert h["running"] == h["waiting"] == 0 and h["token_blocks_used"] == h["concept_blocks_used"] == 0, h
    ids = tok.encode("To be, or not").ids
    want = model.generate(torch.tensor([ids]), 8, temperature=0)[0, len(ids):].tolist()
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(want)


def test_the_openapi_schema_fuzzed_gives_no_5xx(fuzzed):
    url, engine, tok, model = fuzzed
    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    op = schemathesis.openapi.from_dict(spec)["/v1/completions"]["POST"]
    modes = schemathesis.GenerationMode
    seen: list[int] = []

    @settings(max_examples=SCHEMA_CASES, **FUZZ)
    @given(case=op.as_strategy(modes.POSITIVE) | op.as_strategy(modes.NEGATIVE))
    def post(case):
        # sent by requests itself: schemathesis's own call stops reading a stream after a few events
        _check(session.request(**case.as_transport_kwargs(base_url=url), timeout=60), seen)

    t0 = time.perf_counter()
    with torch.no_grad(), requests.Session() as session:
        post()
    print(f"schema fuzz: {len(seen)} cases in {time.perf_counter() - t0:.1f} s, "
          f"statuses {sorted(set(seen))}, {seen.count(200)} answered")
    assert len(seen) >= SCHEMA_CASES * 0.9
    assert seen.count(200) >= len(seen) // 10, "the fuzz hardly reached the engine"
    assert sum(400 <= s < 500 for s in seen) >= len(seen) // 10, "the fuzz hardly tried a bad request"
    _healthy_afterwards(url, engine, tok, model)


# Any JSON, with the values that broke the parser or the sampler once, for any field.
BIG = st.sampled_from([10**400, -(10**400), 2**63, -(2**63) - 1, 2**64, 10**19])
SURROGATE = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udbff", "é\ud834"])
TINY = st.sampled_from([1e-46, 5e-324, 1e-40, 1e-300, 0.0, -0.0, 1e39, 0.999999])
LEAF = (st.none() | st.booleans() | st.integers(-3, 400) | BIG | st.floats(allow_nan=True, allow_infinity=True)
        | TINY | st.text(max_size=8) | SURROGATE)
ANY = st.recursive(LEAF, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4) | SURROGATE, c,
                                                                                max_size=3), max_leaves=8)
HOSTILE = BIG | SURROGATE | TINY | LEAF | ANY  # the known culprits drawn as often as the rest together
NUMBERS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "n", "best_of", "logprobs", "min_tokens",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "concept_ratio"]
NAMES = st.sampled_from(NUMBERS) | st.sampled_from(sorted(KNOWN)) | st.text(max_size=4) | SURROGATE
BIAS = st.dictionaries(st.sampled_from(["5", "9" * 400, "-1", "1e400", " 7", "\u0663", "\ud800"]), HOSTILE, max_size=2)
PLAUSIBLE = {  # values each field takes when valid, so that hostile ones meet otherwise-working requests
    "prompt": st.text(min_size=1, max_size=12) | st.lists(st.integers(0, 319), min_size=1, max_size=6)
    | st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3),
    "max_tokens": st.integers(0, 8), "temperature": st.sampled_from([0, 0.5, 1.0]),
    "top_p": st.sampled_from([1e-46, 1e-40, 0.3, 1.0]), "top_k": st.integers(-1, 8), "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=3), "n": st.integers(1, 3), "logprobs": st.integers(0, 3),
    "echo": st.booleans(), "stream": st.booleans(), "logit_bias": st.dictionaries(
        st.integers(0, 319).map(str), st.floats(-100, 100), max_size=3),
    "concept_ratio": st.sampled_from([1.5, 2.0, 3.0]), "min_tokens": st.integers(0, 2),
}


@st.composite
def bodies(draw) -> bytes:
    """Plausible fields, then up to two fields (the prompt, any known one, or an unknown name) set
    to any JSON at all; ``ensure_ascii`` writes a lone surrogate as its ``\\ud800`` escape."""
    names = draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=5, unique=True))
    body = {name: draw(PLAUSIBLE[name]) for name in ["prompt", *names]}
    for name in draw(st.lists(NAMES, max_size=2)):
        body[name] = draw(BIAS | HOSTILE if name == "logit_bias" else HOSTILE)
    return json.dumps(body, ensure_ascii=True).encode("ascii")


RAW = st.sampled_from([b"[" * 100_000, b'{"prompt": "x", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"\xff\xfe{",
                       b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "x", "max_tokens": ' + b"9" * 4301 + b"}",
                       b"NaN", b""])  # deep nesting, bytes that are not UTF-8, an int past Python's parse limit


def test_hostile_json_in_every_field_gives_no_5xx(fuzzed):
    url, engine, tok, model = fuzzed
    seen: list[int] = []

    @settings(max_examples=HOSTILE_CASES, **FUZZ)
    @given(body=bodies() | RAW)
    def post(body):
        _check(client.post("/v1/completions", content=body), seen)

    t0 = time.perf_counter()
    with torch.no_grad(), httpx.Client(base_url=url, timeout=60,
                                       headers={"Content-Type": "application/json"}) as client:
        post()
    print(f"hostile fuzz: {len(seen)} cases in {time.perf_counter() - t0:.1f} s, "
          f"statuses {sorted(set(seen))}, {seen.count(200)} answered")
    assert len(seen) >= HOSTILE_CASES * 0.9 and seen.count(200) >= len(seen) // 20
    _healthy_afterwards(url, engine, tok, model)

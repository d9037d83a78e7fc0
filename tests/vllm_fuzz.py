"""Hostile traffic for a vLLM server (issue 68 item 4): bounded, seeded batches of requests that mix
what a client can ask, at lengths around the block (32) and prefill-chunk sizes; after each batch
the engine is alive and a greedy request gives ``model.generate``'s tokens.

Each batch sends ``PER_BATCH`` requests at once: random and repeated token ids (random ids make
about one concept a token, far past the estimate; a repeated id makes almost none), ``echo`` with
prompt log-probabilities, ``n`` > 1, seeded sampling, stop strings and token ids, streams, and
streams the client drops after its first event, every kind in every batch. Every answer must be
200, or a 4xx with OpenAI's error JSON; never a 5xx, never a dead engine.
"""

from __future__ import annotations

import json
import random

import httpx

LENGTHS = (1, 2, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 190)
PER_BATCH, BATCHES = 12, 3


KINDS = ("echo", "n", "seed", "stop", "stream", "drop", "logprobs", "plain", "long")


def _body(rng: random.Random, max_len: int, kind: str) -> dict:
    n = rng.choice([n for n in LENGTHS if n + 16 <= max_len])
    ids = [rng.randrange(3, 250) for _ in range(n)] if rng.random() < 0.7 else [rng.randrange(3, 250)] * n
    body = {"prompt": ids, "max_tokens": rng.choice((1, 4, 16)), "temperature": 0}
    if kind == "echo":
        body.update(echo=True, logprobs=1, max_tokens=1)
    elif kind == "n":
        body.update(n=2, temperature=1.0, seed=rng.randrange(100))
    elif kind == "seed":
        body.update(temperature=0.8, top_p=0.9, seed=rng.randrange(100))
    elif kind == "stop":
        body.update(stop=["e", "\n"], stop_token_ids=[rng.randrange(3, 250)], temperature=1.0, seed=1)
    elif kind in ("stream", "drop"):
        body.update(stream=True)
    elif kind == "logprobs":
        body.update(logprobs=2, temperature=1.0, seed=3)
    elif kind == "long":  # its output reaches past --max-model-len: vLLM refuses it or cuts the output short
        body.update(prompt=[7] * (max_len - 2), max_tokens=16)
    body["_kind"] = kind
    return body


def _send(url: str, body: dict) -> tuple[str, int, str]:
    kind = body.pop("_kind")
    with httpx.Client(timeout=300) as client:
        if kind == "drop":  # a client that goes away mid-stream
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    break
                return kind, r.status_code, ""
        r = client.post(url + "/v1/completions", json=body)
        return kind, r.status_code, r.text


def fuzz(url: str, greedy: tuple[list[int], list[int]], max_len: int, seed: int = 0) -> dict:
    """Send the batches; returns what came back by status and kind. ``greedy``: (prompt, the tokens
    ``model.generate`` gives it), asked after each batch; ``max_len``: the server's --max-model-len."""
    import concurrent.futures as cf

    rng = random.Random(seed)
    seen: dict[str, int] = {}
    after = []
    for _ in range(BATCHES):
        start = rng.randrange(len(KINDS))  # every kind in every batch, in a seeded mix
        bodies = [_body(rng, max_len, KINDS[(start + i) % len(KINDS)]) for i in range(PER_BATCH)]
        with cf.ThreadPoolExecutor(PER_BATCH) as pool:
            for kind, status, text in pool.map(lambda b: _send(url, b), bodies):
                seen[f"{kind}:{status}"] = seen.get(f"{kind}:{status}", 0) + 1
                assert status < 500, f"{kind}: {status} {text[:300]}"
                if status >= 400:
                    err = json.loads(text)["error"]
                    assert err["message"], text
                elif kind not in ("stream", "drop"):
                    assert json.loads(text)["choices"], text
                elif kind == "stream":
                    assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        prompt, want = greedy
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": len(want), "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        after.append(r.json()["choices"][0]["token_ids"] == want)
    return {"seen": seen, "exact_after": after}

"""What real clients send: lm-eval's local-completions, ``vllm bench serve``, vLLM's sampling extras.

The payloads are built here as those clients build them (``test_serve_lm_eval.py`` runs lm-eval's
own ``local-completions``), and sent to a live server on 127.0.0.1 (``serve_helpers.live_server``).
Log-probabilities are held to the model's own log-softmax, their ``text_offset`` to characters of
the returned text; penalties, bias and min_tokens to a full-recompute reference.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from hf_helpers import concept_run
from serve_helpers import live_server, wait_idle

import conceptmoe.serve.engine as engine_mod
from conceptmoe.serve.text import TextTracker

NAME = "cm-served"


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-api")
    model = concept_run(root / "cm", seed=0, seq_len=128)
    with live_server(root / "cm", kv_cache_mb=2, max_batch=16, served_model_name=NAME) as (url, engine, tok):
        yield url, engine, tok, model


def _post(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy(model, ids: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([ids]), n, temperature=0)[0, len(ids):].tolist()


def test_served_model_name(served):
    url = served[0]
    assert httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"] == NAME
    r = httpx.post(url + "/v1/completions", json={"model": "cm", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and NAME in r.json()["error"]["message"]
    assert _post(url, {"model": NAME, "prompt": "x", "max_tokens": 2})["model"] == NAME


def test_lm_eval_loglikelihood_logprobs_equal_the_models_log_softmax(served):
    url, _, tok, model = served
    ctx, cont = tok.encode("To be, or not to be").ids, tok.encode(" that is the question").ids
    other = tok.encode("All the world's a stage").ids
    # lm-eval local-completions, loglikelihood: token ids, echo, one top logprob, one new token
    body = {"model": NAME, "prompt": [ctx + cont, other], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    out = _post(url, body)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for ids, choice in zip([ctx + cont, other], choices):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and choice["text"].startswith(tok.decode(ids))
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, V)
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(torch.tensor(lp["token_logprobs"][1:len(ids)]), want, atol=1e-4)
        nxt = int(ref[-1].argmax())  # greedy: the new token is the argmax, its logprob the max
        assert lp["tokens"][-1] == tok.decode([nxt])
        assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1, nxt]), abs=1e-4)
        for top, lpt in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]):
            assert max(top.values()) >= lpt - 1e-6 and len(top) <= 2
    # what lm-eval computes from it: the continuation's log-likelihood and whether it is greedy
    lp = choices[0]["logprobs"]
    ref = model(torch.tensor([ctx + cont])).logits[0].float().log_softmax(-1)
    want = sum(float(ref[i - 1, t]) for i, t in enumerate(ctx + cont) if i >= len(ctx))
    assert sum(lp["token_logprobs"][len(ctx):-1]) == pytest.approx(want, abs=1e-3)
    assert out["usage"]["prompt_tokens"] == len(ctx + cont) + len(other)


def test_lm_eval_generate_until_with_many_stop_strings(served):
    url, _, tok, model = served
    ids = tok.encode("The king").ids
    text = tok.decode(_greedy(model, ids, 30))
    stops = ["<|endoftext|>", "\n\n", "Question:", "zzz", "yyy", "xxx", text[8:11]]
    body = {"prompt": [ids], "model": NAME, "max_tokens": 30, "temperature": 0, "stop": stops, "seed": 1234}
    c = _post(url, body)["choices"][0]
    assert c["text"] == text[:text.index(text[8:11])] and c["finish_reason"] == "stop"


def test_vllm_bench_serve_payload_works_unchanged(served):
    url, _, tok, model = served
    prompt = "Now is the winter of our discontent"
    body = {"model": NAME, "prompt": prompt, "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 12,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer EMPTY"}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == tok.decode(_greedy(model, tok.encode(prompt).ids, 12))


def test_n_choices_plain_and_streamed(served):
    url, tok = served[0], served[2]
    out = _post(url, {"prompt": "Once", "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in out["choices"]}) > 1, "n choices drew the same text"
    assert out["usage"]["completion_tokens"] == 24 and out["usage"]["prompt_tokens"] == len(tok.encode("Once").ids)
    again = _post(url, {"prompt": "Once", "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True})
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]]
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": "Once", "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True,
            "stream": True}) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    texts = {i: "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in range(3)}
    assert texts == {c["index"]: c["text"] for c in out["choices"]}
    assert sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]) == [0, 1, 2]
    assert events[-1]["usage"]["completion_tokens"] == 24


def _processed_greedy(model, ids: list[int], n: int, rep=1.0, pres=0.0, freq=0.0, bias=None, min_tokens=0,
                      banned=()) -> list[int]:
    """vLLM's logits processing over a full recompute per token: the reference for the server."""
    out: list[int] = []
    for _ in range(n):
        x = model(torch.tensor([ids + out])).logits[0, -1].float()
        for t, b in (bias or {}).items():
            x[t] += b
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[torch.tensor(ids + out)] = True
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        for t in set(out):
            x[t] -= freq * out.count(t) + pres
        if len(out) < min_tokens:
            x[list(banned)] = float("-inf")
        out.append(int(x.argmax()))
    return out


def test_penalties_bias_min_tokens_and_stop_token_ids(served):
    url, _, tok, model = served
    ids = tok.encode("The quality of mercy").ids
    extras = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"7": 2.5}}
    got = _post(url, {"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extras})
    want = _processed_greedy(model, ids, 16, 1.3, 0.5, 0.3, {7: 2.5})
    assert want != _greedy(model, ids, 16), "the extras changed nothing: the test would not see them"
    assert got["choices"][0]["text"] == tok.decode(want)
    ref = _greedy(model, ids, 16)
    k = next(i for i in range(1, 16) if ref[i] not in ref[:i])
    c = _post(url, {"prompt": ids, "max_tokens": 16, "temperature": 0, "stop_token_ids": [ref[k]]})["choices"][0]
    assert c["text"] == tok.decode(ref[:k]) and c["finish_reason"] == "stop"
    c = _post(url, {"prompt": ids, "max_tokens": 6, "temperature": 0, "stop_token_ids": [ref[0]], "min_tokens": 3,
                    "ignore_eos": True})["choices"][0]
    want = _processed_greedy(model, ids, 6, min_tokens=3, banned=[ref[0]])
    assert want[0] != ref[0]
    assert c["text"] == tok.decode(want[:want.index(ref[0], 3)] if ref[0] in want[3:] else want)


def test_usage_counts_the_tokens_returned_after_a_stop_string(served):
    url, _, tok, model = served
    ids = tok.encode("The king").ids
    ref = _greedy(model, ids, 30)
    text = tok.decode(ref)
    stop = text[6:9]
    k = next(i for i in range(1, 31) if stop in tok.decode(ref[:i]))
    for stream in (False, True):
        body = {"prompt": ids, "max_tokens": 30, "temperature": 0, "stop": stop, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}
        if stream:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                usage = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"][-1]["usage"]
        else:
            usage = _post(url, body)["usage"]
        assert usage["completion_tokens"] == k


def test_echo_alone_returns_the_prompt(served):
    url = served[0]
    c = _post(url, {"prompt": "Friends, Romans", "max_tokens": 0, "echo": True})
    assert c["choices"][0]["text"] == "Friends, Romans" and c["usage"]["completion_tokens"] == 0


def test_a_multibyte_stop_string_streams_what_the_plain_answer_returns(served):
    tok = served[2]
    byte = {b: tok.token_to_id(ch) for b, ch in zip((0xC3, 0xA9), ("Ã", "©"))}  # byte-level tokens of é
    ids = tok.encode("ab").ids + [byte[0xC3], byte[0xA9]] + tok.encode("cd").ids
    assert tok.decode(ids) == "abécd"
    for stop in ("bé", "é", "bécd", "abz"):
        streamed = TextTracker(tok, [stop])
        text = ""
        for t in ids:
            streamed.add([t])
            text += streamed.pending()
            if streamed.stopped:
                break
        text += streamed.pending(final=True)
        plain = TextTracker(tok, [stop])
        plain.add(ids)
        full = "abécd"
        want = full[:full.index(stop)] if stop in full else full
        assert text == plain.pending(final=True) == want, stop


def test_a_plain_request_whose_client_leaves_is_cancelled_within_a_step(served, monkeypatch):
    url, engine, _, _ = served
    real = engine_mod.decode_step

    def slow(*a, **kw):
        time.sleep(0.02)
        return real(*a, **kw)
    monkeypatch.setattr(engine_mod, "decode_step", slow)
    finished = []
    engine.on_finish, on_finish = (lambda r: (finished.append(r), on_finish(r))), engine.on_finish
    try:
        with pytest.raises(httpx.ReadTimeout):  # 120 tokens take > 2.4 s; the client gives up at 0.5 s
            httpx.post(url + "/v1/completions", json={"prompt": "Tomorrow", "max_tokens": 120, "ignore_eos": True},
                       timeout=0.5)
        h = wait_idle(url, timeout=1.5)
        assert h["running"] == 0 and h["token_blocks_used"] == 0
    finally:
        engine.on_finish = on_finish
    assert finished and finished[-1].finish_reason == "cancelled" and len(finished[-1].generated) < 100


def _offsets_of(tok, ids: list[int]) -> list[int]:
    """Reference text_offset: characters of the whole-prefix decode, less an unfinished character."""
    return [len(tok.decode(ids[:j]).rstrip("\ufffd")) for j in range(len(ids))]


def test_text_offset_counts_characters_not_bytes(served):
    url, _, tok, _ = served
    prompt = "Œuvre — 5 € ou ½?"  # 2-, 3- and 2-byte characters, none holding the bytes of é
    ids = tok.encode(prompt).ids
    assert len(ids) > len(prompt) and tok.decode(ids) == prompt
    e = {ch: tok.token_to_id(ch) for ch in ("Ã", "©")}  # the byte tokens of é (0xC3 0xA9)
    # bias and repetition penalty make the completion exactly é: Ã first, then © (Ã, seen, is halved)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0,
            "logit_bias": {str(e["Ã"]): 100, str(e["©"]): 60}, "repetition_penalty": 2.0, "ignore_eos": True}
    c = _post(url, body)["choices"][0]
    assert c["text"] == prompt + "é"
    want = _offsets_of(tok, ids) + [len(prompt), len(prompt)]  # both bytes of é start where é does
    assert c["logprobs"]["text_offset"] == want
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    streamed = [o for ev in events for ch in ev["choices"] for o in (ch["logprobs"] or {}).get("text_offset", [])]
    assert streamed == want
    plain = _post(url, {**body, "echo": False})["choices"][0]  # without echo, offsets count from the completion
    assert plain["text"] == "é" and plain["logprobs"]["text_offset"] == [0, 0]

"""Issue 51: served by vLLM (CPU build), through ``conceptmoe serve --engine vllm`` and the plugin.

- The MoE export (Qwen2-MoE) in vLLM gives ``model.generate``'s greedy tokens.
- A ConceptMoE and an elastic ConceptMoE (exported at R = 3; R = 2 and 4 per request) give, for 10 concurrent prompts of
  different lengths, token for token what ``model.generate`` gives each alone, with chunked
  prefill forced small (prompts split across steps, across boundary decisions) and with a KV budget
  that binds (requests wait, and are preempted); the ConceptMoE compiled (its token-rate and
  concept stacks through inductor), the elastic run eager and compiled, its four concept layers in
  two KV-cache groups.
- vLLM's accounting reflects the concept cache: at the same KV bytes its "KV cache size" is
  1/(KV ratio) times the MoE's.

One server per model for the whole module (start-up is slow). Models are tiny (head_dim 32: vLLM's
CPU attention takes 32 to 512) with random independent weights (``hf_helpers.concept_run``).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch

from vllm_helpers import complete, metric, need_vllm, vllm_server

need_vllm()

from hf_helpers import concept_run  # noqa: E402

from conceptmoe import load_run  # noqa: E402
from vllm_fuzz import KINDS, fuzz  # noqa: E402
from vllm_load import (BUDGET_MB, LENGTHS, LONG_ARGS, NEW, SHAPE, VLLM_ARGS, check_cached, prompts,  # noqa: E402
                       serve_and_check)

LARGE_MB = 64  # a KV budget that does not bind: the fuzz at the other end from BUDGET_MB


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    concept_run(root / "moe", kind="moe", seq_len=128, **SHAPE)
    concept_run(root / "cm", seq_len=128, **SHAPE)
    # four concept layers against two token layers: vLLM gives them two KV-cache groups (the
    # concept metadata is built once and given each group's blocks)
    concept_run(root / "elastic", seed=1, seq_len=128, elastic_ratios=[2.0, 4.0], ratio_embedding="router+concept",
                n_layers=6, **SHAPE)
    return root


@pytest.fixture(scope="module")
def moe(runs):
    return serve_and_check(runs, "moe", vllm_args=LONG_ARGS)


@pytest.fixture(scope="module")
def cm(runs):
    return serve_and_check(runs, "cm", fuzzed=True)


@pytest.fixture(scope="module")
def cm_estimated(runs):
    """The ConceptMoE with 64-token steps (prefill chunks the estimate applies to) and an estimate
    of one new concept a step (CONCEPTMOE_VLLM_ESTIMATE): a prompt that fills its concept blocks
    outruns it, is recomputed, and must still be exact."""
    return serve_and_check(runs, "cm", label="cm-estimated", vllm_args=LONG_ARGS.replace("batched-tokens 16",
                                                                                       "batched-tokens 64"),
                           env={"CONCEPTMOE_VLLM_ESTIMATE": "0.01,0"}, fuzzed=True)


def test_moe_export_in_vllm_is_exact(moe, runs):
    assert (runs / "moe" / "vllm-export" / "config.json").is_file()  # exported on the way
    assert moe["got"] == moe["want"]
    assert moe["again"] == moe["want"][:3]
    assert moe["grown"] == moe["want_grow"]  # under the binding budget
    assert moe["preemptions"] > 0
    check_cached(moe)


def test_long_contexts_past_training_are_served(moe, cm_estimated):
    """Positions past the training length: the MoE export's RoPE table and the ConceptMoE's, both
    exact against model.generate (which extrapolates RoPE the same way)."""
    for figures in (moe, cm_estimated):
        assert figures["long"] == figures["want_long"]


def test_conceptmoe_in_vllm_is_exact_with_chunked_prefill_and_preemption(cm):
    assert cm["got"] == cm["want"]
    assert cm["again"] == cm["want"][:3]
    assert cm["grown"] == cm["want_grow"]
    assert cm["preemptions"] > 0  # the budget binds: requests were preempted and recomputed
    assert cm["copies"] == [cm["want"][8]] * 12  # batch invariance
    check_cached(cm)


def test_conceptmoe_is_exact_when_its_estimate_falls_short(cm_estimated):
    """Concept slots from an estimate too small: the model writes nothing past the grant, the
    scheduler drops the step's output and recomputes the request at the safe bound; tokens exact."""
    assert cm_estimated["recomputed"] > 0
    assert cm_estimated["got"] == cm_estimated["want"]
    assert cm_estimated["again"] == cm_estimated["want"][:3]
    assert cm_estimated["grown"] == cm_estimated["want_grow"]
    check_cached(cm_estimated)  # hits on prefixes whose later steps were flagged and recomputed


def test_a_flagged_step_leaves_no_trace(cm, cm_estimated, moe):
    """Issue 68: echo + logprobs over a prompt flagged at its last chunk (it killed vLLM's engine),
    and seeded sampling across a flag (the dropped draw moved the generator): the estimated
    server's log-probabilities are the model's, and its seeded texts are the unforced server's."""
    assert cm_estimated["recomputed"] > 0
    for figures in (cm, cm_estimated, moe):
        assert figures["echo"] == pytest.approx(figures["want_echo"], abs=2e-4)
    assert cm_estimated["seeded"] == cm["seeded"]
    assert cm_estimated["seeded_flag_recomputed"] >= 1 and cm["seeded_flag_recomputed"] == 0
    assert cm_estimated["seeded_flag"] == cm["seeded_flag"]
    assert cm_estimated["again"] == cm_estimated["want"][:3]  # alive, and exact, after it


def test_hostile_traffic_never_stops_the_engine(cm, cm_estimated):
    """Issue 68 item 4 (tests/vllm_fuzz.py): the default estimate and one forced short, at a budget
    that binds; echo, n, seeds, stops, streams and dropped streams, random and repeated ids."""
    for figures in (cm, cm_estimated):
        assert all(figures["fuzz"]["exact_after"]), figures["fuzz"]
        kinds = {k.split(":")[0] for k in figures["fuzz"]["seen"]}
        assert kinds == set(KINDS), figures["fuzz"]["seen"]
    assert cm_estimated["recomputed"] > 0


def test_vllm_tokenize(cm, moe):
    """Issue 68: the served model tokenizes text as its run (vLLM's /tokenize on held-out text;
    the MoE export once took Qwen2's pre-tokenizer and NFC)."""
    for figures in (cm, moe):
        assert figures["tokenized"] == figures["want_tokenized"]


def test_concept_ratio_is_refused_where_it_cannot_be_served(cm, moe):
    assert moe["refused"][0] == 400 and "ConceptMoE runs only" in moe["refused"][1]
    assert cm["refused"][0] == 400 and "trained for R=2 only" in cm["refused"][1]


def test_seeded_sampling_does_not_depend_on_the_batch(cm, moe):
    for figures in (cm, moe):
        short_alone, short_batched, long_alone, long_batched = figures["seeded"]
        assert short_alone[0] == short_alone[1] == short_batched[0] == short_batched[1]
        assert long_alone[0] == long_alone[1] == long_batched[0] == long_batched[1]
        assert long_alone[0] != figures["want"][8]  # sampled, not greedy


def test_vllm_counts_the_concept_cache(cm, moe):
    """Half the layers at concept rate (R = 2): KV bytes per token 0.75x the MoE's, so 1/0.75 the tokens."""
    assert cm["kv_tokens"] / moe["kv_tokens"] == pytest.approx(1 / 0.75, rel=0.02)
    # How the scheduler fills the concept group is tested without a server (test_vllm_kv.py); how many
    # requests a binding budget runs at once is the benchmark's to measure (bench serve --engine vllm).


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_elastic_run_in_vllm_is_exact(runs, eager):
    from conceptmoe.interop import export_hf

    folder = runs / "elastic-R3"
    if not (folder / "config.json").is_file():
        export_hf(runs / "elastic", folder, concept_ratio=3.0)
    model, *_ = load_run(runs / "elastic", "cpu")
    model.eval()
    want = [model.generate(torch.tensor([p]), NEW, temperature=0, ratio=3.0)[0, len(p):].tolist()
            for p in prompts()]
    # Per request: R = 2, 4 or the export's 3, mixed in one batch (vLLM's extra fields, vllm_xargs).
    mixed = [(2.0, 4.0, None)[i % 3] for i in range(len(LENGTHS))]
    want_mixed = [model.generate(torch.tensor([p]), NEW, temperature=0, ratio=r or 3.0)[0, len(p):].tolist()
                  for p, r in zip(prompts(), mixed)]
    assert want_mixed != want  # the ratio changes the output: the test can tell them apart
    # Eager (--enforce-eager, the path on CUDA) and compiled: the ratio terms enter the compiled router.
    # eager at the binding budget; compiled at a large one, where it also takes the hostile traffic
    budget = BUDGET_MB if eager else LARGE_MB
    with vllm_server(folder, runs / f"elastic-{eager}.log", "--kv-cache-mb", str(budget), "--max-batch", "16",
                     "--vllm-args", VLLM_ARGS + (" --enforce-eager" if eager else "")) as url:
        assert complete(url, prompts(), NEW) == want
        xargs = [{"vllm_xargs": {"concept_ratio": r}} if r else {} for r in mixed]
        assert complete(url, prompts(), NEW, per_prompt=xargs) == want_mixed
        # Prefix caching: the 57-token prompt alone at R 4, twice (the second finds the first's 32-token
        # prefix), then at R 2 (R is in its hashes: it must not find R 4's) and at the export's R.
        hits = metric(url, "vllm:prefix_cache_hits_total")
        for r in (4.0, 4.0, 2.0, None, None):
            want_r = model.generate(torch.tensor([prompts()[8]]), NEW, temperature=0, ratio=r or 3.0)[0, 57:].tolist()
            extra = [{"vllm_xargs": {"concept_ratio": r}} if r else {}]
            assert complete(url, [prompts()[8]], NEW, per_prompt=extra) == [want_r], r
        assert metric(url, "vllm:prefix_cache_hits_total") >= hits + 2 * 32
        for bad, why in ((9.0, "outside the trained range [2, 4]"), ("2", "must be a number"),
                         (1.0, "finite number > 1")):
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": prompts()[0], "max_tokens": 2, "vllm_xargs": {"concept_ratio": bad}})
            assert r.status_code == 400 and why in r.text, (bad, r.status_code, r.text[:300])
        assert complete(url, prompts()[:2], NEW) == want[:2]  # still serving
        if not eager:
            hostile = fuzz(url, (prompts()[0], want[0]), 128)
            assert all(hostile["exact_after"]), hostile
            assert {k.split(":")[0] for k in hostile["seen"]} == set(KINDS), hostile["seen"]

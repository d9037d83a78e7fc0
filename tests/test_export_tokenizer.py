"""Issue 68 item 2: every export tokenizes as its run did.

``AutoTokenizer`` (what vLLM and lm-eval's ``hf`` model load) on an export must give the run's own
token ids on held-out text, byte for byte, with the run's special tokens: for each MoE family
(Qwen2-MoE, OLMoE, Qwen3-MoE), a ConceptMoE, an elastic ConceptMoE, a converted MoE, and a MoE
imported from its export and exported again. Before the fix a MoE export had no
tokenizer_config.json, and ``AutoTokenizer`` took the tokenizer class of its ``model_type``
(Qwen2's regex and NFC): "\\n\\n" became one token the model never saw. The vLLM server's
``/tokenize`` is held to the same in test_vllm_tokenize (tests/test_vllm.py).
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from hf_helpers import VOCAB, concept_run  # noqa: E402

from conceptmoe.data.corpus import load_corpus  # noqa: E402
from conceptmoe.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer  # noqa: E402
from conceptmoe.interop import export_hf, import_hf  # noqa: E402
from conceptmoe.interop.convert import convert_run  # noqa: E402
from conceptmoe.training.conventions import token_ids  # noqa: E402

HELD_OUT = load_corpus().val[0].text[:30000]  # a held-out play: line breaks, blank lines, punctuation


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs with a tokenizer as ``conceptmoe train`` makes them (byte-level BPE, <|endoftext|>, <|pad|>)."""
    root = tmp_path_factory.mktemp("export-tok")
    tok = train_tokenizer([d.text for d in load_corpus().train[:3]], VOCAB)
    specs = {"moe": dict(kind="moe"), "moe-olmoe": dict(kind="moe", qk_norm="full", n_shared_experts=0),
             "moe-qwen3_moe": dict(kind="moe", qk_norm="head", n_shared_experts=0),
             "cm": {}, "elastic": dict(elastic_ratios=[2.0, 3.0])}
    for name, over in specs.items():
        concept_run(root / name, **over)
        save_tokenizer(tok, root / name / "tokenizer.json")
    convert_run(root / "moe", root / "converted", ratio=2.0, split="1+2+1")
    return root


def _check(run, export) -> None:
    tok = load_tokenizer(run / "tokenizer.json")
    hf = transformers.AutoTokenizer.from_pretrained(str(export))
    want = tok.encode(HELD_OUT).ids
    assert hf.encode(HELD_OUT, add_special_tokens=False) == want
    assert hf.decode(want) == HELD_OUT
    ids = token_ids(json.loads((run / "config.json").read_text()), tok)
    eot = tok.token_to_id("<|endoftext|>")
    assert eot is not None and hf.convert_tokens_to_ids("<|endoftext|>") == eot
    assert hf.encode("a<|endoftext|>b", add_special_tokens=False) == tok.encode("a<|endoftext|>b").ids
    assert hf.eos_token_id == ids["eos_token_id"] and hf.bos_token_id == ids["bos_token_id"]
    if ids["pad_token_id"] is not None:
        assert hf.pad_token_id == ids["pad_token_id"]


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "qwen3_moe"])
def test_moe_exports_tokenize_as_the_run(runs, tmp_path, arch):
    run = runs / ("moe" if arch == "qwen2_moe" else f"moe-{arch}")
    export_hf(run, tmp_path / arch, arch=arch)
    assert json.loads((tmp_path / arch / "config.json").read_text())["model_type"] == arch
    assert (tmp_path / arch / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    _check(run, tmp_path / arch)


@pytest.mark.parametrize("name", ["cm", "elastic", "converted"])
def test_conceptmoe_exports_tokenize_as_the_run(runs, tmp_path, name):
    export_hf(runs / name, tmp_path / name)
    _check(runs / name, tmp_path / name)


def test_an_imported_and_reexported_moe_tokenizes_as_the_run(runs, tmp_path):
    export_hf(runs / "moe", tmp_path / "hf", arch="qwen2_moe")
    import_hf(tmp_path / "hf", tmp_path / "imported")
    export_hf(tmp_path / "imported", tmp_path / "again")
    _check(tmp_path / "imported", tmp_path / "again")
    assert (load_tokenizer(tmp_path / "imported" / "tokenizer.json").encode(HELD_OUT).ids
            == load_tokenizer(runs / "moe" / "tokenizer.json").encode(HELD_OUT).ids)

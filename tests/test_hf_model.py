"""ConceptMoE through transformers (issue 11 A): export, from_pretrained, generate, the cache, round trip.

Every model here has random, independent weights (router, joint decoding, norms), so a mis-wired
path changes the logits. Nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
import transformers as tr
from hf_helpers import concept_run, left_padded

from conceptmoe.cli import main
from conceptmoe.interop.hf_cache import ConceptMoECache
from conceptmoe.interop.hf_model import CACHE_FIELD, ConceptMoEForCausalLM

PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [8], [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [64, 65]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    ours = concept_run(root / "run", seed=1, concept_pooling="mean", concept_loops=2)
    assert main(["export-hf", str(root / "run"), "--out", str(root / "hf")]) == 0
    return ours, root


@pytest.fixture(scope="module")
def hf(exported):
    return tr.AutoModelForCausalLM.from_pretrained(exported[1] / "hf", trust_remote_code=True).eval()


def test_directory_is_self_contained(exported, monkeypatch):
    ours, root = exported
    out = root / "hf"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "conceptmoe" and set(cfg["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    assert cfg["conceptmoe"] == ours.cfg.to_dict()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "configuration_conceptmoe.py", "modeling_conceptmoe.py"):
        assert (out / name).is_file(), name
    tok = tr.AutoTokenizer.from_pretrained(out)
    text = "If music be the food of love, play on;\n\nGive me excess of it"
    from tokenizers import Tokenizer
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(root / "run" / "tokenizer.json")).encode(text).ids
    assert tok.decode(tok(text)["input_ids"]) == text and tok.pad_token == "<|pad|>"


def _load_in_fresh_process(path) -> None:
    """A new interpreter that never imported conceptmoe: trust_remote_code finds the folder's code."""
    code = ("import transformers as tr, torch; "
            f"m = tr.AutoModelForCausalLM.from_pretrained({str(path)!r}, trust_remote_code=True); "
            "assert type(m).__module__.startswith('transformers_modules'), type(m).__module__; "
            "print(m(torch.tensor([[5, 6, 7]])).logits.shape)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch.Size([1, 3, 320])" in r.stdout


def test_fresh_process_loads_offline_with_remote_code(exported):
    _load_in_fresh_process(exported[1] / "hf")


def test_registered_without_remote_code(exported):
    m = tr.AutoModelForCausalLM.from_pretrained(exported[1] / "hf")
    assert type(m) is ConceptMoEForCausalLM and type(m.config).__name__ == "ConceptMoEConfig"


@torch.no_grad()
def test_logits_match_ours_on_a_left_padded_batch(exported, hf):
    ours = exported[0]
    ids, mask = left_padded(PROMPTS, pad=320)  # the pad id lies outside the vocabulary: never embedded
    theirs = hf(input_ids=ids, attention_mask=mask).logits
    worst = 0.0
    for i, p in enumerate(PROMPTS):
        mine = ours(torch.tensor([p])).logits[0]
        worst = max(worst, (mine - theirs[i, ids.shape[1] - len(p):]).abs().max().item())
    assert worst < 1e-4
    assert theirs[mask == 0].abs().max() == 0  # padding positions are zeros, not garbage


@torch.no_grad()
def test_out_of_vocabulary_padding_without_a_mask_is_padding(hf):
    ids, mask = left_padded(PROMPTS, pad=320)
    torch.testing.assert_close(hf(input_ids=ids).logits, hf(input_ids=ids, attention_mask=mask).logits)


@torch.no_grad()
def test_greedy_generate_equals_ours_token_for_token(exported, hf):
    ours = exported[0]
    ids, mask = left_padded(PROMPTS)
    a = ours.generate(ids, 24, temperature=0, attention_mask=mask)
    b = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    assert torch.equal(a, b)
    c = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, use_cache=False)
    assert torch.equal(a, c)  # the cache changes nothing


@torch.no_grad()
def test_sampling_and_eos_behave_as_transformers_documents(exported, hf):
    ids, mask = left_padded(PROMPTS)
    greedy = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    top1 = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=1)
    assert torch.equal(greedy, top1)  # top_k=1 sampling is greedy
    torch.manual_seed(3)
    s1 = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                     temperature=1.5, top_p=0.9)
    torch.manual_seed(3)
    s2 = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                     temperature=1.5, top_p=0.9)
    assert torch.equal(s1, s2) and not torch.equal(s1, greedy)
    T = ids.shape[1]
    eos = int(greedy[0, T + 2])  # row 0 emits it at step 3
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                      eos_token_id=eos, pad_token_id=0)
    row = out[0, T:].tolist()
    assert row[:3] == greedy[0, T:T + 3].tolist() and all(t == 0 for t in row[3:])
    for i in range(1, len(PROMPTS)):  # the other rows are untouched up to their own eos
        g = greedy[i, T:].tolist()
        n = g.index(eos) + 1 if eos in g else len(g)
        assert out[i, T:T + n].tolist() == g[:n]


@torch.no_grad()
def test_beam_search_with_the_cache_equals_recompute(hf):
    ids, mask = left_padded(PROMPTS)
    a = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=3, do_sample=False)
    b = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=3, do_sample=False,
                    use_cache=False)
    assert torch.equal(a, b)
    r = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False,
                    num_return_sequences=2)
    assert r.shape[0] == 2 * len(PROMPTS)


@torch.no_grad()
def test_cache_argument_and_its_deprecated_alias(hf, exported):
    ours = exported[0]
    seq = torch.tensor([PROMPTS[2]])
    full = ours(seq).logits[0]
    out = hf(input_ids=seq[:, :5], use_cache=True)
    cache = getattr(out, CACHE_FIELD)  # "cache" from transformers 5.20 on, "past_key_values" before
    assert isinstance(cache, ConceptMoECache) and cache.get_seq_length() == 5
    assert not type(hf)._supports_default_dynamic_cache()
    nxt = hf(input_ids=seq[:, 5:9], cache=cache)  # several tokens at once through the cache
    assert (nxt.logits[0] - full[5:9]).abs().max() < 1e-4
    last = hf(input_ids=seq[:, 9:10], past_key_values=getattr(nxt, CACHE_FIELD))  # deprecated name still works
    assert (last.logits[0, -1] - full[9]).abs().max() < 1e-4
    assert cache.state.concept_counts() == [int(ours(seq[:, :10]).boundaries.sum())]
    with pytest.raises(NotImplementedError, match="roll back"):
        cache.crop(1)


def test_save_pretrained_round_trip_is_exact(hf, tmp_path):
    hf.save_pretrained(tmp_path / "again")
    _load_in_fresh_process(tmp_path / "again")  # the saved folder is as self-contained as the export
    again = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True).eval()
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids, attention_mask=mask).logits,
                           again(input_ids=ids, attention_mask=mask).logits)


def test_import_conceptmoe_stays_free_of_transformers():
    code = "import sys, conceptmoe; assert 'transformers' not in sys.modules; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]

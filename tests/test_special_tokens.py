"""Issue 19, generation conventions: real special tokens, exports that carry bos/eos/pad, EOS in generation.

- a run whose tokenizer has <|endoftext|> / <|pad|> exports them as EOS / PAD, pad inside the vocabulary;
- batched transformers ``generate(..., attention_mask=..., eos_token_id=...)`` with left padding
  equals our ``generate`` row by row, rows finishing at different steps;
- an imported checkpoint's bos/eos/pad (generation_config.json first) survive import, convert and export;
- ``conceptmoe generate`` stops at end-of-text.
"""

from __future__ import annotations

import json

import pytest
import torch

tr = pytest.importorskip("transformers")
from hf_helpers import VOCAB, concept_run, left_padded  # noqa: E402
from safetensors.torch import save_model  # noqa: E402

from conceptmoe import load_run  # noqa: E402
from conceptmoe.cli import main  # noqa: E402
from conceptmoe.data.corpus import load_corpus  # noqa: E402
from conceptmoe.data.tokenizer import EOT, PAD, save_tokenizer, train_tokenizer  # noqa: E402
from conceptmoe.interop import convert_run, export_hf, import_hf  # noqa: E402
from conceptmoe.training.conventions import max_length, prefix_id, token_ids  # noqa: E402

PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [8], [300, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [64, 65]]


def special_run(path, seed=1, **over):
    """A ConceptMoE run (random weights) whose tokenizer has <|endoftext|> and <|pad|>."""
    model = concept_run(path, seed=seed, **over)
    tok = train_tokenizer([load_corpus().val[0].text[:20000]], VOCAB)
    save_tokenizer(tok, path / "tokenizer.json")
    return model, tok


@pytest.fixture(scope="module", params=["special", "legacy"])
def exported(tmp_path_factory, request):
    """An export of a run with special tokens, and of one made before them (no EOS, no pad token)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "special":
        model, tok = special_run(root / "run")
    else:
        model = concept_run(root / "run", seed=1)
        _, _, tok, _ = load_run(root / "run", "cpu")
    assert main(["export-hf", str(root / "run"), "--out", str(root / "hf")]) == 0
    return model, tok, root


def test_export_names_end_of_text_and_an_in_vocabulary_pad(exported):
    _, tok, root = exported
    if tok.token_to_id(EOT) is None:
        pytest.skip("legacy tokenizer: see test_runs_without_special_tokens_export_an_in_vocabulary_pad")
    cfg = json.loads((root / "hf" / "config.json").read_text())
    gen = json.loads((root / "hf" / "generation_config.json").read_text())
    eot, pad = tok.token_to_id(EOT), tok.token_to_id(PAD)
    assert cfg["eos_token_id"] == gen["eos_token_id"] == eot and cfg["bos_token_id"] is None
    assert cfg["pad_token_id"] == gen["pad_token_id"] == pad < cfg["vocab_size"]
    assert cfg["prefix_token_id"] == eot and cfg["max_position_embeddings"] == 64  # the training length
    hf_tok = tr.AutoTokenizer.from_pretrained(root / "hf")
    assert (hf_tok.eos_token, hf_tok.pad_token) == (EOT, PAD) and len(hf_tok) == tok.get_vocab_size()


def _eos_for_rows(model, ids, mask, n):
    """An id that ends some rows early and not others in greedy decoding (so that padding is fed)."""
    free = model.generate(ids, n, temperature=0, attention_mask=mask)[:, ids.shape[1]:]
    for t in free[0, 1:4].tolist():
        ends = [(row == t).nonzero()[0, 0].item() if (row == t).any() else n for row in free]
        if min(ends) < n - 2 and max(ends) == n:
            return t
    pytest.fail(f"no token ends some rows but not all: {free.tolist()}")


@torch.no_grad()
def test_batched_transformers_generate_with_eos_equals_ours_row_by_row(exported):
    model, tok, root = exported
    hf = tr.AutoModelForCausalLM.from_pretrained(root / "hf", trust_remote_code=True).eval()
    ids, mask = left_padded(PROMPTS, pad=hf.generation_config.pad_token_id)
    n = 12
    eos = _eos_for_rows(model, ids, mask, n)
    theirs = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                         eos_token_id=eos)[:, ids.shape[1]:]
    pad = hf.generation_config.pad_token_id
    for i, p in enumerate(PROMPTS):
        mine = model.generate(torch.tensor([p]), n, temperature=0, eos_token_id=eos)[0, len(p):].tolist()
        stop = mine.index(eos) + 1 if eos in mine else n
        row = theirs[i].tolist()
        assert row[:stop] == mine[:stop], (i, row, mine)
        assert all(t == pad for t in row[stop:])  # finished rows are padded with an id of the model
    # the exported default: end-of-text ends a row (the run's EOS), with no argument at all
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == len(PROMPTS)


def _qwen2_with_ids(path):
    from test_interop import make_checkpoint

    ckpt = make_checkpoint(path, "qwen2_moe", num_hidden_layers=4, bos_token_id=3, eos_token_id=4, pad_token_id=5)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 9], "pad_token_id": 5}))
    return ckpt


def test_imported_ids_survive_import_convert_and_export(tmp_path, capsys):
    ckpt = _qwen2_with_ids(tmp_path / "hf")
    run = import_hf(ckpt, tmp_path / "moe")
    model, cfg, tok, run_cfg = load_run(run, "cpu")
    want = {"bos_token_id": 3, "eos_token_id": [4, 9], "pad_token_id": 5}
    assert token_ids(run_cfg, tok) == want and prefix_id(want, tok) == 3
    assert max_length(run_cfg) == 512  # the source's max_position_embeddings (no training config)
    old = json.loads(json.dumps(run_cfg))  # an import made before token ids were kept in the model config
    del old["model"]["extra"]["token_ids"]
    assert token_ids(old, tok) == {"bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 5}  # source config.json
    back = json.loads((export_hf(run, tmp_path / "back") / "config.json").read_text())
    assert {k: back[k] for k in want} == want and back["max_position_embeddings"] == 512
    assert tr.AutoModelForCausalLM.from_pretrained(tmp_path / "back").generation_config.eos_token_id == [4, 9]
    conv = convert_run(run, tmp_path / "cm", ratio=1)
    cm = export_hf(conv, tmp_path / "cm-hf")
    got = json.loads((cm / "config.json").read_text())
    assert {k: got[k] for k in want} == want and got["prefix_token_id"] == 3
    assert got["max_position_embeddings"] == 512
    bad = tmp_path / "bad"
    import shutil
    shutil.copytree(ckpt, bad)
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**6}))
    assert main(["import-hf", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "eos_token_id" in capsys.readouterr().err


def test_runs_without_special_tokens_export_an_in_vocabulary_pad(tmp_path):
    """A run made before special tokens: no EOS, pad_token_id still an id of the model."""
    concept_run(tmp_path / "run", seed=3)  # hf_helpers' tokenizer: no special tokens, 320 entries
    cfg = json.loads((export_hf(tmp_path / "run", tmp_path / "hf") / "config.json").read_text())
    assert cfg["eos_token_id"] is None and 0 <= cfg["pad_token_id"] < cfg["vocab_size"]
    assert cfg["pad_token_id"] == cfg["prefix_token_id"]  # the last token of DOC_SEP


def test_cli_generate_stops_at_end_of_text(tmp_path, capsys):
    model, tok = special_run(tmp_path / "run", seed=4)
    eot = tok.token_to_id(EOT)
    prompt = "To be, or not"
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():  # make end-of-text win where one of the greedy tokens would, after some text
        free = model.generate(ids, 30, temperature=0)[0, ids.shape[1]:].tolist()
        row = model.lm_head.weight[eot].clone()
        for t in dict.fromkeys(free[1:]):
            model.lm_head.weight[eot] = 1.5 * model.lm_head.weight[t]
            new = model.generate(ids, 30, temperature=0)[0, ids.shape[1]:].tolist()
            if eot in new and 0 < new.index(eot) < 25:
                break
            model.lm_head.weight[eot] = row
    assert eot in new and new.index(eot) > 0, new
    save_model(model, str(tmp_path / "run" / "model.safetensors"))
    assert main(["generate", str(tmp_path / "run"), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "30", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    k = new.index(eot)
    assert out.out == tok.decode(ids[0].tolist() + new[:k]) + "\n"  # the prompt, then the text before end-of-text
    assert out.err.startswith(f"{k + 1} tokens in ")

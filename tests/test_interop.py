"""import-hf / export-hf: our logits and greedy tokens equal transformers' on tiny random checkpoints."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model

tr = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hf_helpers import shrunk_config

from conceptmoe import ModelConfig, build_model, load_run
from conceptmoe.cli import main
from conceptmoe.errors import UserError
from conceptmoe.interop import export_hf, import_hf
from conceptmoe.training.checkpoint import RUN_FORMAT, RUN_VERSION, write_json

VOCAB = 300
CLASSES = {"olmoe": (tr.OlmoeConfig, tr.OlmoeForCausalLM), "qwen2_moe": (tr.Qwen2MoeConfig, tr.Qwen2MoeForCausalLM),
           "qwen3_moe": (tr.Qwen3MoeConfig, tr.Qwen3MoeForCausalLM)}
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [1, 2, 3], [200, 201, 9, 9, 9, 13, 77, 31, 8, 64, 120, 4], [66]]


def hf_config(arch, **over):
    """transformers' default config, shrunk in sizes only (Qwen2-MoE keeps its q/k/v biases)."""
    return shrunk_config(arch, VOCAB, **over)  # Qwen3-MoE: head_dim 16, 4 x 16 != 48


@torch.no_grad()
def randomize(model, seed):
    """Independent random weights (norms around 1, not 1) so that any mis-mapped tensor shows."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def tokenizer(path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["to be or not to be, that is the question"] * 20, trainer)
    tok.save(str(path))


def make_checkpoint(path, arch, keys="per_expert", shard=False, dtype=torch.float32, seed=0, **over):
    """A tiny random HF checkpoint directory; ``keys="fused"`` writes transformers 5's in-memory keys."""
    model = CLASSES[arch][1](hf_config(arch, **over))
    randomize(model, seed)
    if keys == "per_expert":
        model.to(dtype).save_pretrained(path, max_shard_size="40KB" if shard else "5GB")
        assert (path / "model.safetensors.index.json").is_file() == shard
    else:
        model.save_pretrained(path)
        (path / "model.safetensors").unlink()
        sd = {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in sd)
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer(path / "tokenizer.json")
    return path


def load_hf(path, arch):
    return CLASSES[arch][1].from_pretrained(path, dtype=torch.float32).eval()


def left_padded(prompts):
    T = max(map(len, prompts))
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = torch.tensor(p), 1
    return ids, mask


@torch.no_grad()
def max_logit_diff(ours, hf, prompts=PROMPTS):
    """Largest |ours - HF| over the real positions of a left-padded ragged batch."""
    ids, mask = left_padded(prompts)
    theirs = hf(input_ids=ids, attention_mask=mask).logits
    worst = 0.0
    for i, p in enumerate(prompts):
        mine = ours(torch.tensor([p])).logits[0]
        worst = max(worst, (mine - theirs[i, ids.shape[1] - len(p):]).abs().max().item())
    return worst


@torch.no_grad()
def greedy(ours, hf, n=8):
    ids, mask = left_padded(PROMPTS)
    eos = hf.generation_config.eos_token_id  # OLMoE's default has one: rows stop there
    a = ours.generate(ids, n, temperature=0, attention_mask=mask, eos_token_id=eos)[:, ids.shape[1]:]
    b = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                    pad_token_id=0 if eos is None else eos)[:, ids.shape[1]:]
    return a, b


CASES = [
    ("olmoe", dict()),
    ("olmoe", dict(norm_topk_prob=True, tie_word_embeddings=True, shard=True)),
    ("qwen2_moe", dict(keys="fused")),
    ("qwen2_moe", dict(norm_topk_prob=True, shard=True, dtype=torch.bfloat16)),
    ("qwen3_moe", dict(norm_topk_prob=True)),
    ("qwen3_moe", dict(keys="fused", tie_word_embeddings=True, dtype=torch.bfloat16)),
]


@pytest.mark.parametrize("arch,kw", CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(CASES)])
def test_import_matches_transformers(tmp_path, arch, kw):
    src = make_checkpoint(tmp_path / "hf", arch, **kw)
    run = import_hf(src, tmp_path / "run")
    ours, cfg, _, run_cfg = load_run(run, "cpu")
    hf = load_hf(src, arch)
    assert run_cfg["format"] == RUN_FORMAT and run_cfg["source"]["architecture"] == CLASSES[arch][1].__name__
    assert cfg.kind == "moe" and cfg.n_kv_heads == 2 and cfg.norm_topk_prob == kw.get("norm_topk_prob", False)
    assert cfg.tie_embeddings == kw.get("tie_word_embeddings", False) and cfg.rope_theta == 10000.0
    assert cfg.attn_bias == ("qkv" if arch == "qwen2_moe" else "none")  # transformers' defaults
    assert cfg.head_dim == (16 if arch == "qwen3_moe" else 12)
    assert (run / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    diff = max_logit_diff(ours, hf)
    assert diff < 1e-4, diff
    a, b = greedy(ours, hf)
    assert torch.equal(a, b), (a, b)


def test_a_wrong_mapping_is_caught(tmp_path):
    """The exactness check can fail: swap two experts of one layer and the logits move."""
    src = make_checkpoint(tmp_path / "hf", "olmoe")
    ours, *_ = load_run(import_hf(src, tmp_path / "run"), "cpu")
    with torch.no_grad():
        w = ours.layers[1].moe.w_up
        w[[0, 1]] = w[[1, 0]]
    assert max_logit_diff(ours, load_hf(src, "olmoe")) > 1e-3


@pytest.mark.parametrize("arch", list(CLASSES))
def test_round_trip_export(tmp_path, arch):
    src = make_checkpoint(tmp_path / "hf", arch, seed=1)
    run = import_hf(src, tmp_path / "run")
    out = export_hf(run, tmp_path / "back")
    assert json.loads((out / "config.json").read_text())["architectures"] == [CLASSES[arch][1].__name__]
    a, b = load_hf(src, arch), load_hf(out, arch)
    ids = torch.tensor(PROMPTS[2:3])
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    assert import_hf(out, tmp_path / "again").is_dir()  # the export imports again


def _our_run(path, cfg, seed=0):
    model = build_model(cfg)
    randomize(model, seed)
    path.mkdir()
    save_model(model, str(path / "model.safetensors"))
    tokenizer(path / "tokenizer.json")
    write_json(path / "config.json", {"format": RUN_FORMAT, "version": RUN_VERSION, "name": cfg.name,
                                      "model": cfg.to_dict(), "train": {}})
    return model.eval()


@pytest.mark.parametrize("over", [dict(shared_expert_gate=False), dict(n_shared_experts=0)],
                         ids=["ungated-shared", "no-shared"])
def test_export_our_moe_as_qwen2(tmp_path, over):
    """Our own MoE (no QK-norm, shared expert without a gate, or none) exports exactly to Qwen2-MoE."""
    cfg = ModelConfig.from_preset("tiny", kind="moe", vocab_size=VOCAB, **over)
    ours = _our_run(tmp_path / "run", cfg)
    assert main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf = load_hf(tmp_path / "hf", "qwen2_moe")
    assert max_logit_diff(ours, hf) < 1e-4


def _fail(capsys, argv, *words):
    capsys.readouterr()  # drop transformers' progress bars from making the checkpoint
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err


def test_export_refuses_conceptmoe_and_mismatched_arch(tmp_path, capsys):
    _our_run(tmp_path / "cm", ModelConfig.from_preset("tiny", vocab_size=VOCAB))
    _fail(capsys, ["export-hf", str(tmp_path / "cm"), "--out", str(tmp_path / "x"), "--arch", "olmoe"], "ConceptMoE")
    _our_run(tmp_path / "moe", ModelConfig.from_preset("tiny", kind="moe", vocab_size=VOCAB))
    _fail(capsys, ["export-hf", str(tmp_path / "moe"), "--out", str(tmp_path / "x"), "--arch", "olmoe"], "qk_norm")
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def qwen3_src(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("q3") / "hf", "qwen3_moe")


def _edited(src, tmp_path, edit):
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("field,value", [("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                                         ("use_sliding_window", True), ("attention_bias", 1),
                                         ("hidden_act", "gelu"), ("made_up_field", 1)])
def test_import_refuses_what_it_cannot_represent(qwen3_src, tmp_path, capsys, field, value):
    src = _edited(qwen3_src, tmp_path, lambda c: c.update({field: value}))
    _fail(capsys, ["import-hf", str(src), "--out", str(tmp_path / "run")], field)
    assert not (tmp_path / "run").exists()


def test_import_refuses_other_families_fields(tmp_path, capsys, qwen3_src):
    src = _edited(qwen3_src, tmp_path, lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                             "rope_theta": 1e4}))
    _fail(capsys, ["import-hf", str(src), "--out", str(tmp_path / "r1")], "rope_type")
    olmoe = make_checkpoint(tmp_path / "olmoe", "olmoe")
    for field, value in (("clip_qkv", 8.0), ("sliding_window", 64)):
        src = _edited(olmoe, tmp_path / field, lambda c, f=field, v=value: c.update({f: v}))
        _fail(capsys, ["import-hf", str(src), "--out", str(tmp_path / "r2")], field)
    qwen2 = make_checkpoint(tmp_path / "qwen2", "qwen2_moe")
    src = _edited(qwen2, tmp_path / "bias", lambda c: c.update(qkv_bias="yes"))
    _fail(capsys, ["import-hf", str(src), "--out", str(tmp_path / "r3")], "qkv_bias")


def test_import_refuses_unknown_and_missing_tensors(qwen3_src, tmp_path, capsys):
    src = _edited(qwen3_src, tmp_path, lambda c: None)
    sd = load_file(src / "model.safetensors")
    save_file({**sd, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(src / "model.safetensors"))
    _fail(capsys, ["import-hf", str(src), "--out", str(tmp_path / "run")], "model.layers.0.mlp.extra.weight")
    sd.pop("model.layers.2.mlp.experts.5.down_proj.weight")
    save_file(sd, str(src / "model.safetensors"))
    _fail(capsys, ["import-hf", str(src), "--out", str(tmp_path / "run")], "model.layers.2.mlp.experts.5.down_proj")
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    _fail(capsys, ["import-hf", str(src), "--out", str(tmp_path / "run")], "pickled")


def test_out_needs_force(qwen3_src, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["import-hf", str(qwen3_src), "--out", str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    _fail(capsys, ["import-hf", str(qwen3_src), "--out", str(out)], "--force")
    assert main(["import-hf", str(qwen3_src), "--out", str(out), "--force"]) == 0
    assert (out / "model.safetensors").read_bytes() == before
    assert main(["export-hf", str(out), "--out", str(tmp_path / "hf")]) == 0
    _fail(capsys, ["export-hf", str(out), "--out", str(tmp_path / "hf")], "--force")
    assert main(["export-hf", str(out), "--out", str(tmp_path / "hf"), "--force"]) == 0
    with pytest.raises(UserError):
        import_hf(tmp_path / "nowhere", tmp_path / "r")


def test_imported_run_works_with_the_cli(qwen3_src, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["import-hf", str(qwen3_src), "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["flops", "--config", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "moe"
    assert main(["generate", str(run), "--prompt", "to be", "--max-new-tokens", "4", "--temperature", "0",
                 "--device", "cpu"]) == 0

"""``conceptmoe convert`` (issue 10 B): a MoE run -> a ConceptMoE run, key by key, with an exact start.

Exactness: OLMoE, Qwen2-MoE and Qwen3-MoE checkpoints made at test time with transformers are
imported with import-hf and converted at R = 1 (fixed router: every token a concept with p = 1);
the converted model's logits equal the source MoE's (and transformers') within 1e-4, in the full
forward pass and in cached decoding.
"""

import json

import pytest
import torch

from conceptmoe import ModelConfig, build_model, count_flops, load_run
from conceptmoe.cli import main
from conceptmoe.errors import UserError
from conceptmoe.interop import convert_run, import_hf
from conceptmoe.interop.convert import converted_config, default_split
from conceptmoe.training.checkpoint import RUN_FORMAT, RUN_VERSION, write_json

IDS = torch.tensor([[5, 17, 250, 3, 99, 42, 7, 1, 2, 3, 200, 201, 9, 9, 13, 77],
                    [66, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])


def moe_run(path, seed=0, **over):
    """A MoE run directory with independent random weights (norms included)."""
    cfg = ModelConfig.from_preset("tiny", kind="moe", n_layers=6, **over)
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) * p.shape[-1] ** -0.5)
    from conceptmoe.interop.hf_run import save_weights
    from tokenizers import Tokenizer, models
    path.mkdir(parents=True)
    save_weights(cfg, model.state_dict(), path / "model.safetensors")
    Tokenizer(models.BPE()).save(str(path / "tokenizer.json"))
    write_json(path / "config.json", {"format": RUN_FORMAT, "version": RUN_VERSION, "name": cfg.name,
                                      "model": cfg.to_dict(), "train": {}})
    return path


@torch.no_grad()
def logits_of(run, ids=IDS):
    model, cfg, _, _ = load_run(run, "cpu")
    return model(ids).logits, model, cfg


@pytest.mark.parametrize("arch", ["olmoe", "qwen2_moe", "qwen3_moe"])
def test_exact_start_for_imported_checkpoints(tmp_path, arch):
    tr = pytest.importorskip("transformers")  # noqa: F841
    from test_interop import load_hf, make_checkpoint

    ckpt = make_checkpoint(tmp_path / "hf", arch, num_hidden_layers=4, norm_topk_prob=arch != "olmoe")
    src = import_hf(ckpt, tmp_path / "moe")
    hf = load_hf(ckpt, arch)
    want, moe, _ = logits_of(src)
    with torch.no_grad():
        assert (hf(input_ids=IDS).logits - want).abs().max() < 1e-4
    for name, kw in [("default", {}), ("loops1", {"loops": 1, "split": "1+2+1"}),
                     ("thin", {"split": "1+1+2", "joint_layers": 1})]:
        run = convert_run(src, tmp_path / name, ratio=1, **kw)
        got, model, cfg = logits_of(run)
        assert cfg.is_concept and cfg.chunk_router == "fixed" and cfg.dechunk_source == "update"
        diff = (got - want).abs().max().item()
        assert diff < 1e-4, (name, diff)
        # Cached decoding of the converted model gives the source's next-token logits too.
        gen = model.generate(IDS[:, :6], 6, temperature=0)
        ref = moe.generate(IDS[:, :6], 6, temperature=0)
        assert torch.equal(gen, ref)


def test_every_tensor_lands_where_the_split_says(tmp_path):
    src = moe_run(tmp_path / "moe", n_shared_experts=1)
    run = convert_run(src, tmp_path / "cm", ratio=2.0, split="2+3+1")
    a, _, _, _ = load_run(src, "cpu")
    b, cfg, _, _ = load_run(run, "cpu")
    sa, sb = a.state_dict(), b.state_dict()
    stages = ["encoder.0", "encoder.1", "concept.0", "concept.1", "concept.2", "decoder.0"]
    for key, t in sa.items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            key = f"{stages[int(i)]}.{rest}"
        assert torch.equal(sb[key], t), key
    assert torch.equal(b.chunk.wq.weight, torch.eye(cfg.d_model))
    assert torch.equal(b.chunk.wk.weight, torch.eye(cfg.d_model))
    for lin in (b.decoder[0].attn.jq, b.decoder[0].attn.jk, b.decoder[0].attn.jv):
        assert not lin.weight.any()
    new = {k for k in sb if k.startswith("chunk.") or ".attn.j" in k}
    assert len(sb) == len(sa) + len(new)
    stored = json.loads((run / "config.json").read_text())
    assert stored["source"]["split"] == [2, 3, 1] and sorted(stored["source"]["new_tensors"]) == sorted(new)
    assert cfg.compression_ratio == 2.0 and cfg.chunk_router == "cosine" and cfg.name == "ConceptMoE-1L-top2-R2"


def test_joint_layers_and_loops(tmp_path):
    src = moe_run(tmp_path / "moe")
    run = convert_run(src, tmp_path / "cm", ratio=1.5, split="1+3+2", joint_layers=1, loops=3)
    b, cfg, _, _ = load_run(run, "cpu")
    assert [blk.attn.joint for blk in b.decoder] == [False, True]
    assert cfg.concept_loops == 3 and cfg.name == "ConceptMoE-3L-loop3-top2-R1.5"
    assert count_flops(cfg)["total_params"] == b.num_params()


def test_default_split():
    assert default_split(27) == (2, 23, 2)
    assert default_split(8) == (2, 4, 2) and default_split(6) == (2, 2, 2)
    assert default_split(5) == (1, 3, 1) and default_split(3) == (1, 1, 1)
    assert default_split(40) == (3, 34, 3)
    with pytest.raises(UserError, match="at least 3"):
        default_split(2)


@pytest.mark.parametrize("strategy", ["topk", "loop"])
def test_compute_matched_conversion(strategy):
    src = ModelConfig.from_preset("small", kind="moe")
    for ratio in ((1.5, 2.0) if strategy == "topk" else (2.0,)):
        cfg = converted_config(src, ratio, strategy=strategy)
        fr = count_flops(cfg)["activated_flops_per_token"] / count_flops(src)["activated_flops_per_token"]
        assert abs(fr - 1) <= 0.03, (ratio, fr)
        assert cfg.concept_experts == src.n_experts and cfg.top_k == src.top_k  # no new experts
        assert (cfg.concept_loops > 1) == (strategy == "loop")
    if strategy == "loop":  # two loops at R = 1.5 cost 8/6 of the concept layers; top-1 cannot pay it back
        with pytest.raises(UserError, match="within 3%"):
            converted_config(src, 1.5, strategy=strategy)
    # Unmatched conversions save the concept layers' half: 6 of 8 layers on 1 + 6 + 1, 4 of 8 on
    # the default 2 + 4 + 2 (plus the router and the attention that still runs per token)
    src_flops = count_flops(src)["activated_flops_per_token"]
    assert count_flops(converted_config(src, 2.0, split=(1, 6, 1)))["activated_flops_per_token"] < 0.8 * src_flops
    assert 0.8 * src_flops < count_flops(converted_config(src, 2.0))["activated_flops_per_token"] < 0.9 * src_flops


def test_refusals(tmp_path):
    src = moe_run(tmp_path / "moe")
    src_cfg = ModelConfig.from_preset("tiny", kind="moe", n_layers=6)
    with pytest.raises(UserError, match="layers needs new layers"):
        converted_config(src_cfg, 2.0, strategy="layers")
    with pytest.raises(UserError, match="fixed by the source"):
        converted_config(src_cfg, 2.0, overrides={"d_model": 64})
    with pytest.raises(UserError, match="--split"):
        converted_config(src_cfg, 2.0, overrides={"n_encoder_layers": 2})
    with pytest.raises(UserError, match="chunk_router=fixed"):
        converted_config(src_cfg, 1.0, overrides={"chunk_router": "cosine"})
    with pytest.raises(UserError, match=">= 1"):
        converted_config(src_cfg, 0.5)
    with pytest.raises(UserError, match="joint-layers"):
        converted_config(src_cfg, 2.0, joint_layers=3)  # more than the 2 decoder layers of 2 + 2 + 2
    for split, msg in [("1+1", "E\\+C\\+D"), ("1+2+2", "covers 5"), ("0+5+1", "positive")]:
        with pytest.raises(UserError, match=msg):
            convert_run(src, tmp_path / "x", split=split)
    cm = convert_run(src, tmp_path / "cm")
    with pytest.raises(UserError, match="already a ConceptMoE"):
        convert_run(cm, tmp_path / "cm2")
    before = (cm / "model.safetensors").read_bytes()
    with pytest.raises(UserError, match="holds a run"):
        convert_run(src, cm, ratio=1.5)
    assert (cm / "model.safetensors").read_bytes() == before
    with pytest.raises(UserError, match="differ"):
        convert_run(src, src, force=True)
    convert_run(src, cm, ratio=1.5, force=True)
    assert load_run(cm, "cpu")[1].compression_ratio == 1.5
    assert not (tmp_path / "x").exists()


def test_cli_convert_and_flops(tmp_path, capsys):
    src = moe_run(tmp_path / "moe")
    assert main(["convert", str(src), "--out", str(tmp_path / "cm"), "--ratio", "2", "--loops", "2"]) == 0
    out = capsys.readouterr().out
    assert "ConceptMoE-2L-loop2" in out and "activated FLOPs/token" in out
    assert main(["flops", "--config", str(tmp_path / "cm"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"].startswith("ConceptMoE-2L-loop2")
    assert main(["convert", str(src), "--out", str(tmp_path / "cm")]) == 2
    assert "pass --force" in capsys.readouterr().err

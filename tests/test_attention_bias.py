"""Issue 19, real checkpoints: attention biases (Qwen2-MoE's q/k/v, OLMoE / Qwen3-MoE's attention_bias)
through import-hf, convert (exact at R = 1), export-hf, the transformers ConceptMoE, FLOPs and
parameter counts; layouts we do not represent are refused naming the field.

Fixtures are transformers' default configs shrunk in sizes only (``hf_helpers.shrunk_config``).
"""

import json

import pytest
import torch

tr = pytest.importorskip("transformers")

from hf_helpers import shrunk_config  # noqa: E402
from test_interop import _edited, _fail, load_hf, make_checkpoint, max_logit_diff  # noqa: E402

from conceptmoe import ModelConfig, build_model, count_flops, load_run  # noqa: E402
from conceptmoe.cli import main  # noqa: E402
from conceptmoe.errors import UserError  # noqa: E402
from conceptmoe.interop import convert_run, export_hf, import_hf  # noqa: E402
from conceptmoe.interop.hf_config import hf_config_from_model, model_config_from_hf  # noqa: E402

IDS = torch.tensor([[5, 17, 250, 3, 99, 42, 7, 1, 2, 3, 200, 201], [66, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
BIASED = [("qwen2_moe", {}), ("olmoe", {"attention_bias": True}), ("qwen3_moe", {"attention_bias": True})]


@pytest.mark.parametrize("attn_bias", ["none", "qkv", "qkvo"])
@pytest.mark.parametrize("kind", ["moe", "conceptmoe"])
def test_parameter_count_and_flops_include_biases(kind, attn_bias):
    cfg = ModelConfig.from_preset("tiny", kind=kind, attn_bias=attn_bias)
    model = build_model(cfg)
    assert count_flops(cfg)["total_params"] == model.num_params()
    biases = [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert len(biases) == {"none": 0, "qkv": 3, "qkvo": 4}[attn_bias] * cfg.n_layers
    assert all(float(p.abs().max()) == 0 for n, p in model.named_parameters() if n.endswith(".bias"))
    base = count_flops(cfg.replace(attn_bias="none"))["activated_flops_per_token"]
    qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = {"none": 0, "qkv": qd + 2 * kvd, "qkvo": qd + 2 * kvd + cfg.d_model}[attn_bias]
    weight = cfg.n_encoder_layers + cfg.n_decoder_layers + cfg.n_concept_layers / cfg.compression_ratio \
        if cfg.is_concept else cfg.n_layers
    assert count_flops(cfg)["activated_flops_per_token"] == pytest.approx(base + per_layer * weight)
    assert "attn_bias" not in ModelConfig.from_preset("tiny").to_dict()  # old configs: byte-identical


@pytest.mark.parametrize("arch,over", BIASED, ids=[a for a, _ in BIASED])
def test_biased_checkpoints_import_convert_export_exactly(tmp_path, arch, over):
    ckpt = make_checkpoint(tmp_path / "hf", arch, num_hidden_layers=4, **over)
    hf = load_hf(ckpt, arch)
    assert any(n.endswith("q_proj.bias") for n, _ in hf.named_parameters())
    run = import_hf(ckpt, tmp_path / "moe")
    ours, cfg, _, _ = load_run(run, "cpu")
    assert cfg.attn_bias == ("qkv" if arch == "qwen2_moe" else "qkvo")
    assert ours.num_params() == sum(p.numel() for p in hf.parameters()) == count_flops(cfg)["total_params"]
    assert max_logit_diff(ours, hf) < 1e-4
    # export-hf back to the same family: the same network, biases included
    back = load_hf(export_hf(run, tmp_path / "back"), arch)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=IDS).logits, back(input_ids=IDS).logits)
    # convert at R = 1: exactly the source, and the ConceptMoE export computes the same
    conv = convert_run(run, tmp_path / "cm", ratio=1)
    cm, _, _, _ = load_run(conv, "cpu")
    with torch.no_grad():
        want = hf(input_ids=IDS).logits
        assert (cm(IDS).logits - want).abs().max() < 1e-4
        exported = tr.AutoModelForCausalLM.from_pretrained(export_hf(conv, tmp_path / "cm-hf"),
                                                           trust_remote_code=True, dtype=torch.float32)
        assert (exported(input_ids=IDS).logits - want).abs().max() < 1e-4


def test_a_dropped_bias_is_caught(tmp_path):
    """The exactness check can fail: zero one imported bias and the logits move."""
    ckpt = make_checkpoint(tmp_path / "hf", "qwen2_moe")
    ours, *_ = load_run(import_hf(ckpt, tmp_path / "run"), "cpu")
    with torch.no_grad():
        ours.layers[1].attn.wk.bias.zero_()
    assert max_logit_diff(ours, load_hf(ckpt, "qwen2_moe")) > 1e-3


def test_qkv_biases_export_to_every_family(tmp_path):
    """A q/k/v-bias run exports to OLMoE / Qwen3-MoE with a zero o_proj bias; qkvo is not Qwen2-MoE."""
    cfg = ModelConfig.from_preset("tiny", kind="moe", attn_bias="qkv", n_shared_experts=0)
    assert hf_config_from_model(cfg.replace(qk_norm="head"), "qwen3_moe")["attention_bias"] is True
    assert hf_config_from_model(cfg, "qwen2_moe")["qkv_bias"] is True
    with pytest.raises(UserError, match="o_proj bias"):
        hf_config_from_model(cfg.replace(attn_bias="qkvo"), "qwen2_moe")
    ckpt = make_checkpoint(tmp_path / "hf", "qwen2_moe")  # q/k/v biases, qk_norm none
    run = import_hf(ckpt, tmp_path / "run")
    # our MoE with q/k/v biases exported as Qwen3-MoE would need head QK-norm: refused by name
    with pytest.raises(UserError, match="qk_norm"):
        export_hf(run, tmp_path / "x", arch="qwen3_moe")


DEFAULTS = ["olmoe", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("arch", DEFAULTS)
def test_default_configs_import(arch):
    """transformers' default config of each family (sizes shrunk) imports with its structure kept."""
    hf = shrunk_config(arch, 300).to_dict()
    cfg = model_config_from_hf(hf)
    assert cfg.attn_bias == {"olmoe": "none", "qwen2_moe": "qkv", "qwen3_moe": "none"}[arch]
    assert cfg.shared_expert_gate == (arch == "qwen2_moe") and not cfg.norm_topk_prob and not cfg.tie_embeddings


@pytest.mark.parametrize("arch,field,value,needle", [
    ("qwen2_moe", "mlp_only_layers", [1], "mlp_only_layers"),
    ("qwen3_moe", "mlp_only_layers", [0, 2], "mlp_only_layers"),
    ("qwen2_moe", "decoder_sparse_step", 2, "decoder_sparse_step"),
    ("qwen3_moe", "decoder_sparse_step", 2, "decoder_sparse_step"),
    ("qwen3_moe", "use_sliding_window", True, "use_sliding_window"),
    ("qwen2_moe", "layer_types", ["sliding_attention", "full_attention", "full_attention"], "layer_types"),
])
def test_unrepresented_layouts_are_refused_by_name(tmp_path, capsys, arch, field, value, needle):
    src = make_checkpoint(tmp_path / "hf", arch)
    src = _edited(src, tmp_path, lambda c: c.update({field: value}))
    _fail(capsys, ["import-hf", str(src), "--out", str(tmp_path / "run")], needle)
    assert not (tmp_path / "run").exists()


def test_qwen2_sliding_window_flag_decided_per_layer(tmp_path, capsys):
    """Qwen2-MoE slides odd layers below max_window_layers: refused, unless no layer is one."""
    src = make_checkpoint(tmp_path / "hf", "qwen2_moe")
    on = _edited(src, tmp_path / "on", lambda c: (c.update(use_sliding_window=True, sliding_window=64),
                                                  c.pop("layer_types")))
    _fail(capsys, ["import-hf", str(on), "--out", str(tmp_path / "r1")], "use_sliding_window", "max_window_layers")
    off = _edited(src, tmp_path / "off", lambda c: (c.update(use_sliding_window=True, sliding_window=64,
                                                             max_window_layers=0), c.pop("layer_types")))
    assert main(["import-hf", str(off), "--out", str(tmp_path / "r2")]) == 0
    assert json.loads((tmp_path / "r2" / "config.json").read_text())["model"]["attn_bias"] == "qkv"
    assert set(tr.AutoConfig.from_pretrained(off).layer_types) == {"full_attention"}  # transformers agrees

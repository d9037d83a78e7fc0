"""Hugging Face ``config.json`` <-> our ``ModelConfig`` for the three public MoE families.

Supports starting from pretrained MoEs (issue 10; the baseline block of CONCEPTMOE.md §2b).
``model_config_from_hf`` reads the plain JSON of an ``OlmoeForCausalLM``,
``Qwen2MoeForCausalLM`` or ``Qwen3MoeForCausalLM`` checkpoint (transformers is not needed)
and returns the ModelConfig of the same network. Every field is either mapped, checked to hold
the one value ours represents, or listed as bookkeeping that does not change the function
(token ids, init range, cache flags). Anything else is a one-line ``UserError`` naming the
field: a field we do not understand is refused, never approximated.

``hf_config_from_model`` goes the other way (``export-hf`` and ``bench moe``).
"""

from __future__ import annotations

from typing import Any

from ..errors import UserError
from ..model.config import ModelConfig

ARCHS = {"olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM"}
QK_NORM = {"olmoe": "full", "qwen2_moe": "none", "qwen3_moe": "head"}

# Fields that do not change what the network computes (or that we map below).
BOOKKEEPING = {"_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype",
               "dtype", "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
               "output_router_logits", "router_aux_loss_coef", "max_position_embeddings", "id2label",
               "label2id", "return_dict", "output_attentions", "output_hidden_states", "problem_type",
               "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder", "torchscript",
               "use_return_dict", "num_labels", "tokenizer_class", "prefix", "sep_token_id",
               "decoder_start_token_id", "task_specific_params", "finetuning_task", "add_cross_attention",
               "cross_attention_hidden_size", "is_decoder", "pruned_heads", "tf_legacy_loss",
               "use_bfloat16", "output_scores", "return_dict_in_generate"}
COMMON = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
          "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
          "hidden_act", "attention_dropout"}
PER_ARCH = {
    "olmoe": {"intermediate_size", "clip_qkv", "attention_bias", "sliding_window"},
    "qwen2_moe": {"intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "qkv_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
                  "decoder_sparse_step", "mlp_only_layers"},
    "qwen3_moe": {"intermediate_size", "moe_intermediate_size", "attention_bias", "use_sliding_window",
                  "sliding_window", "max_window_layers", "layer_types", "decoder_sparse_step",
                  "mlp_only_layers"},
}


def arch_of(hf: dict[str, Any]) -> str:
    """``olmoe`` | ``qwen2_moe`` | ``qwen3_moe`` from ``model_type`` / ``architectures``."""
    mt, names = hf.get("model_type"), hf.get("architectures") or []
    if mt in ARCHS and all(n == ARCHS[mt] for n in names):
        return mt
    raise UserError(f"config.json: model_type {mt!r} / architectures {names} is not one of "
                    f"{', '.join(ARCHS.values())}")


def _refuse(field: str, value: Any, why: str) -> None:
    raise UserError(f"config.json: {field}={value!r} is not supported ({why})")


def _rope_theta(hf: dict[str, Any]) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5) or legacy ``rope_theta``/``rope_scaling``."""
    rp = hf.get("rope_parameters")
    if rp is None:
        rs = hf.get("rope_scaling")
        if rs and (rs.get("rope_type", rs.get("type")) or "default") != "default":
            _refuse("rope_scaling", rs, "only plain RoPE")
        return float(hf.get("rope_theta", 10000.0))
    if not isinstance(rp, dict):
        _refuse("rope_parameters", rp, "expected an object")
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default":
        _refuse("rope_parameters.rope_type", kind, "only plain RoPE")
    extra = sorted(set(rp) - {"rope_type", "type", "rope_theta"})
    if extra:
        _refuse(f"rope_parameters.{extra[0]}", rp[extra[0]], "only plain RoPE")
    if hf.get("rope_scaling"):
        _refuse("rope_scaling", hf["rope_scaling"], "only plain RoPE")
    return float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _check_dense_free(hf: dict[str, Any], arch: str) -> None:
    """Every layer must be a full-attention MoE layer (Qwen dense / sliding-window layers are not).

    Qwen2-MoE decides per layer: ``layer_types`` when given, else transformers' rule (odd
    layers below ``max_window_layers`` slide when ``use_sliding_window``), so a checkpoint whose
    flag is on but whose layers are all full attention imports. Qwen3-MoE slides every layer.
    """
    if hf.get("decoder_sparse_step", 1) != 1:
        _refuse("decoder_sparse_step", hf["decoder_sparse_step"], "dense MLP layers; ours are all MoE")
    if hf.get("mlp_only_layers"):
        _refuse("mlp_only_layers", hf["mlp_only_layers"], "dense MLP layers; ours are all MoE")
    kinds = set(hf.get("layer_types") or [])
    if kinds - {"full_attention"}:
        _refuse("layer_types", sorted(kinds), "sliding-window attention")
    if not hf.get("use_sliding_window"):
        return
    if arch == "qwen3_moe":
        _refuse("use_sliding_window", True, "sliding-window attention")
    n, upto = int(hf.get("num_hidden_layers", 0)), int(hf.get("max_window_layers", 28))
    if not kinds and any((i + 1) % 2 and i < upto for i in range(n)):
        _refuse("use_sliding_window", True, f"sliding-window attention in layers below max_window_layers={upto}")


def _token_ids(hf: dict[str, Any], generation: dict[str, Any] | None) -> dict[str, Any]:
    """bos/eos/pad ids of a checkpoint: ``generation_config.json``'s where it names them (what
    transformers' ``generate`` uses), else ``config.json``'s; each None, an id or (EOS) a list."""
    out = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        src = generation if isinstance(generation, dict) and generation.get(key) is not None else hf
        value = src.get(key)
        ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and
                                         0 <= i < int(hf.get("vocab_size", 0)) for i in ids):
            name = "generation_config.json" if src is generation else "config.json"
            raise UserError(f"{name}: {key}={value!r} is not a token id below vocab_size={hf.get('vocab_size')}")
        out[key] = value
    return out


def model_config_from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """The ModelConfig (kind ``moe``) computing what the HF checkpoint's config describes.

    ``generation``: the checkpoint's ``generation_config.json``, if any (its token ids win).
    """
    arch = arch_of(hf)
    unknown = sorted(set(hf) - BOOKKEEPING - COMMON - PER_ARCH[arch])
    if unknown:
        raise UserError(f"config.json: field {unknown[0]!r} is not understood by the {arch} importer")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf["hidden_act"], "experts are SwiGLU")
    if hf.get("attention_dropout", 0.0):
        _refuse("attention_dropout", hf["attention_dropout"], "ours has no dropout")
    bias_key = "qkv_bias" if arch == "qwen2_moe" else "attention_bias"
    bias = hf.get(bias_key, arch == "qwen2_moe")  # transformers' defaults: Qwen2-MoE has q/k/v biases
    if not isinstance(bias, bool):
        _refuse(bias_key, bias, "expected true or false")
    if arch == "olmoe":
        if hf.get("clip_qkv") is not None:
            _refuse("clip_qkv", hf["clip_qkv"], "no clamping of q/k/v")
        if hf.get("sliding_window") is not None:
            _refuse("sliding_window", hf["sliding_window"], "sliding-window attention")
    else:
        _check_dense_free(hf, arch)
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        hd = int(hf.get("head_dim") or d // heads)
        n_experts = hf.get("num_experts", hf.get("num_local_experts"))
        fields = dict(
            kind="moe", vocab_size=int(hf["vocab_size"]), d_model=d, n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads), n_layers=int(hf["num_hidden_layers"]),
            head_size=0 if hd * heads == d else hd,
            n_experts=int(n_experts), top_k=int(hf["num_experts_per_tok"]),
            expert_hidden=int(hf["intermediate_size"] if arch == "olmoe" else hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)), qk_norm=QK_NORM[arch],
            rope_theta=_rope_theta(hf), norm_eps=float(hf.get("rms_norm_eps", 1e-6 if arch != "olmoe" else 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attn_bias=("qkv" if arch == "qwen2_moe" else "qkvo") if bias else "none",
            balance_loss_weight=float(hf.get("router_aux_loss_coef", 0.01)),
            extra={"hf_architecture": ARCHS[arch], "token_ids": _token_ids(hf, generation)})
        if arch == "qwen2_moe":
            shared = int(hf.get("shared_expert_intermediate_size", 0))
            if shared < 1:
                _refuse("shared_expert_intermediate_size", shared, "Qwen2-MoE always has a shared expert")
            fields.update(n_shared_experts=1, shared_hidden=shared, shared_expert_gate=True)
        if "max_position_embeddings" in hf:
            fields["extra"]["max_position_embeddings"] = int(hf["max_position_embeddings"])
    except KeyError as e:
        raise UserError(f"config.json: required field {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"config.json: a field has the wrong type ({e})") from None
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise UserError(f"config.json describes a model ours cannot build: {e}") from None


def default_arch(cfg: ModelConfig) -> str:
    """The HF family a MoE config exports to: the one it came from, else the one its QK-norm implies."""
    src = cfg.extra.get("hf_architecture")
    for arch, name in ARCHS.items():
        if name == src:
            return arch
    return {"full": "olmoe", "head": "qwen3_moe", "none": "qwen2_moe"}[cfg.qk_norm]


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    """A one-line UserError unless ``arch`` computes exactly what ``cfg`` computes."""
    if cfg.is_concept:
        raise UserError("export-hf: --arch applies to MoE runs; a ConceptMoE run exports without it "
                        "(model_type conceptmoe)")
    if arch not in ARCHS:
        raise UserError(f"unknown --arch {arch!r}; choose from {', '.join(ARCHS)}")
    if cfg.qk_norm != QK_NORM[arch]:
        raise UserError(f"--arch {arch} needs qk_norm={QK_NORM[arch]!r} (the run has {cfg.qk_norm!r})")
    if arch == "qwen2_moe" and cfg.attn_bias == "qkvo":
        raise UserError("--arch qwen2_moe has no o_proj bias (the run has attn_bias='qkvo'); "
                        "export it as olmoe or qwen3_moe")
    if arch != "qwen2_moe" and cfg.n_shared_experts:
        raise UserError(f"--arch {arch} has no shared expert (the run has {cfg.n_shared_experts}); "
                        "only qwen2_moe does")


def hf_config_from_model(cfg: ModelConfig, arch: str) -> dict[str, Any]:
    """``config.json`` of the HF checkpoint computing what ``cfg`` computes (see ``check_exportable``).

    Qwen2-MoE always has a gated shared expert: a run without a gate gets gate weight 0 and
    twice the down projection (sigmoid(0) = 0.5, exact in floating point); a run without a
    shared expert gets one of width 1 with zero weights (contributes exactly 0). Qwen2-MoE always
    declares q/k/v biases (``qkv_bias: true``; zeros for a run without them): vLLM's Qwen2-MoE builds
    them whatever the config says and, finding none in the checkpoint, leaves them uninitialised.
    """
    check_exportable(cfg, arch)
    bias = cfg.attn_bias != "none"  # olmoe/qwen3_moe: a q/k/v-only run gets a zero o_proj bias
    out = dict(architectures=[ARCHS[arch]], model_type=arch, vocab_size=cfg.vocab_size,
               hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
               num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, num_experts=cfg.n_experts,
               num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob, rms_norm_eps=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_dropout=0.0,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
               max_position_embeddings=int(cfg.extra.get("max_position_embeddings", 32768)),
               router_aux_loss_coef=cfg.balance_loss_weight, bos_token_id=None, eos_token_id=None,
               pad_token_id=None, dtype="float32")
    if arch == "olmoe":
        out.update(intermediate_size=cfg.expert_hidden, clip_qkv=None, attention_bias=bias)
    elif arch == "qwen2_moe":
        shared = cfg.n_shared_experts * cfg.shared_size or 1
        out.update(moe_intermediate_size=cfg.expert_hidden, shared_expert_intermediate_size=shared,
                   intermediate_size=shared, qkv_bias=True, use_sliding_window=False,
                   decoder_sparse_step=1, mlp_only_layers=[])
    else:
        out.update(moe_intermediate_size=cfg.expert_hidden, intermediate_size=cfg.expert_hidden,
                   attention_bias=bias, use_sliding_window=False, sliding_window=None,
                   decoder_sparse_step=1, mlp_only_layers=[])
    return out

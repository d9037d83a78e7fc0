"""``convert_run``: a trained or imported MoE run -> a ConceptMoE run (issue 10 B; CONCEPTMOE.md §2, §3, §5).

The continual-training conversion of the paper: the source's blocks are kept and split into
three stages, and only the ConceptMoE modules are new::

    source layers 0..E-1      -> encoder.0..E-1        (token rate)
    source layers E..E+C-1    -> concept.0..C-1        (concept rate, looped ``loops`` times)
    source layers E+C..E+C+D-1 -> decoder.0..D-1       (token rate; joint decoding in the last K)
    embed, norm, lm_head      -> the same keys
    new: chunk.*  (cosine router W_q = W_k = I; none for the fixed router)
         decoder.i.attn.j{q,k,v}  (joint-decoding W', zero)

Every source tensor is used exactly once and every target tensor is either mapped (same shape)
or one of the new modules; anything else is an error. The converted model carries the concept
model's *update* (``dechunk_source="update"``), so at ``ratio=1`` with the fixed router (every
token a concept, p = 1) it computes exactly the source MoE (tested to 1e-4 for OLMoE, Qwen2-MoE
and Qwen3-MoE imports).

Default split (the paper's 27-layer model is 2 + 23 + 2): two token-level layers on each side
from 6 layers on, E = D = max(2, round(2·n/27)) (2 + 4 + 2 at n = 8, the layout the study found
best: in-context copying needs two token-level attention layers, docs/study/round2; 2 + 23 + 2 at
n = 27), one on each side below 6 layers (1 + 1 + 1 at n = 3). The paper's CT puts joint decoding in the last 4 layers; here joint decoding can only
sit in decoder layers (it reads the dechunked concept), so the default is K = D (all of them).

``strategy`` gives the compute-matched variant without new parameters (§3): ``topk`` solves the
concept layers' top-k (more activated experts, same experts), ``loop`` solves the loop count (and
the top-k next to the source's); ``layers`` would need new layers and is refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..model.config import ModelConfig
from ..model.flops import count_flops
from ..model.lm import build_model
from ..files import building, check_out
from ..training.checkpoint import RUN_FORMAT, RUN_VERSION, is_run, load_run, model_config_of, read_run_config, write_json
from ..training.config import MAX_RATIO, flag_error
from ..lock import held
from .hf_run import _copy, _sha256, save_weights

STRATEGIES = ("topk", "layers", "loop")
TOLERANCE = 0.03  # as ``conceptmoe match``: activated FLOPs within 3% of the source's
# --set may not change what the source's weights fix, nor what a flag of its own sets.
SHAPE_FIELDS = ("kind", "vocab_size", "d_model", "n_heads", "n_kv_heads", "n_layers", "head_size",
                "n_experts", "expert_hidden", "n_shared_experts", "shared_hidden", "shared_expert_gate",
                "qk_norm", "attn_bias", "tie_embeddings", "concept_n_experts")
FLAG_FIELDS = {"n_encoder_layers": "--split", "n_decoder_layers": "--split", "compression_ratio": "--ratio",
               "concept_loops": "--loops", "joint_layers": "--joint-layers", "joint_decoding": "--joint-layers"}


def default_split(n_layers: int) -> tuple[int, int, int]:
    """(encoder, concept, decoder) layers: two token-level layers on each side (one below 6 layers),
    more in proportion to the paper's 2 + 23 + 2 beyond 27."""
    if n_layers < 3:
        raise UserError(f"the source has {n_layers} layer(s); a ConceptMoE needs at least 3 "
                        "(encoder, concept model, decoder)")
    edge = max(2 if n_layers >= 6 else 1, round(2 * n_layers / 27))
    return edge, n_layers - 2 * edge, edge


def parse_split(text: str | None, n_layers: int) -> tuple[int, int, int]:
    """``"E+C+D"`` (positive integers summing to the source's layer count); None: the default."""
    if text is None:
        return default_split(n_layers)
    try:
        parts = tuple(int(x) for x in text.split("+"))
    except ValueError:
        parts = ()
    if len(parts) != 3 or min(parts) < 1:
        raise UserError(f"--split must read E+C+D with three positive integers, e.g. 2+23+2 (got {text!r})")
    if sum(parts) != n_layers:
        raise UserError(f"--split {text} covers {sum(parts)} layers but the source has {n_layers}")
    return parts  # type: ignore[return-value]


def converted_config(src: ModelConfig, ratio: float = 2.0, split: tuple[int, int, int] | None = None,
                     loops: int | None = None, joint_layers: int | None = None,
                     overrides: dict[str, Any] | None = None, strategy: str | None = None) -> ModelConfig:
    """The ConceptMoE config a conversion of MoE ``src`` makes (see the module docstring)."""
    overrides = dict(overrides or {})
    for key in overrides:
        if key in SHAPE_FIELDS:
            raise UserError(f"--set {key}: fixed by the source's weights; convert cannot change it")
        if key in FLAG_FIELDS:
            raise UserError(f"--set {key}: use {FLAG_FIELDS[key]} instead")
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and 1 <= ratio <= MAX_RATIO):
        raise UserError(f"--ratio must be a finite number >= 1 and <= {MAX_RATIO} (got {ratio!r})")
    if strategy is not None and strategy not in STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)} (got {strategy!r})")
    if strategy == "layers":
        raise UserError("--strategy layers needs new layers; convert keeps the source's parameters: "
                        "use loop (the concept layers run again) or topk")
    if strategy == "loop" and loops is not None:
        raise UserError("--strategy loop solves the loop count; leave out --loops")
    if strategy and ratio == 1:
        raise UserError("--strategy reinvests compute saved by compression: it needs --ratio > 1")
    if loops is not None and loops < 1:
        raise UserError(f"--loops must be a positive integer (got {loops})")
    E, C, D = split or default_split(src.n_layers)
    K = D if joint_layers is None else joint_layers
    if not 0 <= K <= D:
        raise UserError(f"--joint-layers must be in [0, {D}]: joint decoding sits in the {D} decoder layer(s)")
    router = "fixed" if ratio == 1 else "cosine"
    if ratio == 1 and overrides.get("chunk_router", "fixed") != "fixed":
        raise UserError("--ratio 1 (every token a concept) needs chunk_router=fixed")
    extra = {k: v for k, v in src.extra.items() if k not in ("base_concept_layers", "base_top_k", "strategy")}
    fields = {**src.to_dict(), "kind": "conceptmoe", "n_encoder_layers": E, "n_decoder_layers": D,
              "compression_ratio": float(ratio), "chunk_router": router, "concept_loops": loops or 1,
              "joint_decoding": K > 0, "joint_layers": None if K == D else K, "dechunk_source": "update",
              "concept_n_experts": None, "concept_top_k": None,
              "extra": {**extra, "converted": True, "base_concept_layers": C}, **overrides}
    try:
        cfg = ModelConfig.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise flag_error(e) from None  # names --ratio / --set NAME, not ModelConfig's field
    return _solve(cfg, src, strategy) if strategy else cfg


def _solve(cfg: ModelConfig, src: ModelConfig, strategy: str) -> ModelConfig:
    """Concept top-k (``topk``) or loops and top-k (``loop``) matching the source's activated FLOPs."""
    ref = count_flops(src)["activated_flops_per_token"]
    loop_range = [cfg.concept_loops] if strategy == "topk" else range(2, 17)
    best = None
    for n in loop_range:
        for k in range(1, cfg.concept_experts + 1):
            cand = cfg.replace(concept_loops=n, concept_top_k=None if k == cfg.top_k else k)
            err = abs(count_flops(cand)["activated_flops_per_token"] / ref - 1)
            key = (min(int(err / 0.01 - 1e-9), 3), abs(k - src.top_k), n, err)
            if best is None or key < best[0]:
                best = (key, cand, err)
    _, cand, err = best
    if err > TOLERANCE:
        raise UserError(f"no {strategy} conversion at R={cfg.compression_ratio:g} matches the source's "
                        f"activated FLOPs within {TOLERANCE:.0%} (best: x{1 + err:.3f} or x{1 - err:.3f})")
    return cand.replace(extra={**cand.extra, "strategy": strategy})


def map_state(src_state: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
              cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Source MoE state dict -> the ConceptMoE's, key by key; new modules keep ``target``'s init."""
    E, C = cfg.n_encoder_layers, cfg.n_concept_layers
    out: dict[str, torch.Tensor] = {}
    for key, t in src_state.items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            i = int(i)
            stage, j = ("encoder", i) if i < E else ("concept", i - E) if i < E + C else ("decoder", i - E - C)
            key = f"{stage}.{j}.{rest}"
        if key not in target:
            raise UserError(f"source tensor {key!r} has no place in the ConceptMoE")
        if target[key].shape != t.shape:
            raise UserError(f"{key}: source shape {tuple(t.shape)} != ConceptMoE shape {tuple(target[key].shape)}")
        out[key] = t
    for key in sorted(set(target) - set(out)):
        if not (key.startswith(("chunk.", "ratio_embed.")) or (key.startswith("decoder.") and ".attn.j" in key)):
            raise UserError(f"the ConceptMoE needs {key!r}, which the source does not hold")
        out[key] = target[key]
    return out


def _check_out(src: Path, out: Path, force: bool) -> None:
    if out.resolve() == src.resolve():
        raise UserError("--out must differ from the source run")
    if is_run(out) and not force:
        raise UserError(f"--out {out} holds a run; choose another --out or pass --force to replace it")
    check_out(out, force, replaceable=is_run(out))


def convert_run(src: str | Path, out: str | Path, ratio: float = 2.0, split: str | None = None,
                loops: int | None = None, joint_layers: int | None = None,
                overrides: dict[str, Any] | None = None, strategy: str | None = None,
                force: bool = False, seed: int = 0) -> Path:
    """Write the ConceptMoE conversion of MoE run ``src`` into the run directory ``out``; returns it."""
    src, out = Path(src), Path(out)
    run_cfg = read_run_config(src)
    src_cfg = model_config_of(run_cfg)
    if src_cfg.is_concept:
        raise UserError(f"{src} is already a ConceptMoE; convert takes a MoE run (trained or imported)")
    cfg = converted_config(src_cfg, ratio, parse_split(split, src_cfg.n_layers), loops, joint_layers,
                           overrides, strategy)
    _check_out(src, out, force)
    model, _, _, _ = load_run(src, "cpu")
    torch.manual_seed(seed)  # the new modules' init is deterministic (identity / zero today)
    with torch.no_grad():
        target = build_model(cfg).state_dict()
    state = map_state(model.state_dict(), target, cfg)
    flops_src, flops_new = count_flops(src_cfg), count_flops(cfg)
    train = run_cfg.get("train") or {}
    record = {"tool": "conceptmoe convert", "path": str(src.resolve()), "name": run_cfg.get("name", src_cfg.name),
              "model": src_cfg.to_dict(), "sha256": {"model.safetensors": _sha256(src / "model.safetensors")},
              "split": [cfg.n_encoder_layers, cfg.n_concept_layers, cfg.n_decoder_layers],
              "strategy": strategy, "new_tensors": sorted(k for k in state if _is_new(k)),
              "flops_ratio": flops_new["activated_flops_per_token"] / flops_src["activated_flops_per_token"],
              "params_ratio": flops_new["total_params"] / flops_src["total_params"]}
    # Built in a temporary sibling and renamed into place: a killed conversion leaves no half run.
    with held(out), building(out, "convert", force, is_run(out)) as tmp:
        save_weights(cfg, state, tmp / "model.safetensors")
        _copy(src / "tokenizer.json", tmp / "tokenizer.json")
        doc = {"format": RUN_FORMAT, "version": RUN_VERSION, "name": cfg.name, "model": cfg.to_dict(),
               "train": {"data": train["data"]} if "data" in train else {}, "source": record}
        if "data" in run_cfg:
            doc["data"] = run_cfg["data"]  # `conceptmoe eval` then uses the source's held-out split
        write_json(tmp / "config.json", doc)
    return out


def _is_new(key: str) -> bool:
    return key.startswith("chunk.") or ".attn.j" in key

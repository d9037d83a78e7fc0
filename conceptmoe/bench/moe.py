"""Our MoE block and MoE model against the Hugging Face ``transformers`` implementations.

Checks that ``moe.MoE`` / ``model.MoELM`` (CONCEPTMOE.md §2b) represent public MoE blocks
exactly and are at least as fast. Three architectures, each a small random config built
locally (no downloads), with our weights copied into the Hugging Face model by the mapping of
``interop/`` (the one ``import-hf`` / ``export-hf`` use):

- ``olmoe``: OLMoE — QK-norm over the full projection (``qk_norm="full"``), no shared
  expert, no top-k renormalisation;
- ``qwen2_moe``: Qwen2-MoE — one shared expert behind a sigmoid gate (``shared_expert_gate``);
- ``qwen3_moe``: Qwen3-MoE — per-head QK-norm (``qk_norm="head"``), ``norm_topk_prob``.

``compare(arch, ...)`` returns, for the MoE block alone and for the whole model: the largest
absolute output difference, and median forward and forward+backward times of both, with
``hf / ours`` time ratios (> 1: ours is faster). Hugging Face runs with its default experts
implementation (``grouped_mm`` when it can dispatch, else its eager loop over experts) and
SDPA attention; ``hf_experts="eager"`` picks the loop. Models are compared in eval mode
(no dropout anywhere) in fp32.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..device import machine
from ..errors import UserError
from ..files import write_text
from ..interop.hf_config import ARCHS as ARCHS_HF
from ..interop.hf_config import hf_config_from_model
from ..interop.hf_weights import to_hf
from ..model.config import ModelConfig
from ..model.lm import build_model

ARCHS = ("olmoe", "qwen2_moe", "qwen3_moe")


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("bench moe needs Hugging Face transformers: pip install -e '.[hf]'") from None
    return transformers


def our_config(arch: str, preset: str = "small", n_layers: int | None = None) -> ModelConfig:
    """Our MoE config in the style of ``arch`` (preset sizes, no tied embeddings)."""
    if arch not in ARCHS:
        raise UserError(f"unknown --arch {arch!r}; choose from {', '.join(ARCHS)}")
    style = {"olmoe": dict(qk_norm="full", n_shared_experts=0, norm_topk_prob=False),
             "qwen2_moe": dict(qk_norm="none", n_shared_experts=1, shared_expert_gate=True,
                               norm_topk_prob=False),
             "qwen3_moe": dict(qk_norm="head", n_shared_experts=0, norm_topk_prob=True)}[arch]
    over = dict(kind="moe", tie_embeddings=False, **style)
    if n_layers:
        over["n_layers"] = n_layers
    return ModelConfig.from_preset(preset, **over)


def hf_model(cfg: ModelConfig, arch: str, experts: str | None = None):
    """The Hugging Face causal LM with the same shapes as ``cfg`` (random weights)."""
    tr = require_transformers()
    cls = getattr(tr, ARCHS_HF[arch])
    fields = hf_config_from_model(cfg, arch)
    fields.pop("model_type")
    kw = {"attn_implementation": "sdpa"}
    if experts:
        kw["experts_implementation"] = experts
    return cls._from_config(cls.config_class(**fields), **kw)


@torch.no_grad()
def copy_weights(ours, hf) -> None:
    """Copy every parameter of our MoELM into the Hugging Face model (``interop.hf_weights`` mapping)."""
    hf.load_state_dict(to_hf(ours.state_dict(), ours.cfg, hf.config.model_type, fused=True), strict=True)


def _time_pair(fa, fb, repeats: int) -> tuple[float, float]:
    """Median seconds of fa and fb, alternating them so that machine noise hits both alike."""
    fa(), fb()  # warm-up
    ta, tb = [], []
    for _ in range(repeats):
        for f, ts in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def _fwd_bwd(module, make_out):
    def run():
        module.zero_grad(set_to_none=True)
        make_out().float().pow(2).mean().backward()
    return run


@dataclass
class Comparison:
    arch: str
    part: str  # "moe_block" or "model"
    tokens: int
    max_abs_diff: float
    ours_fwd_s: float
    hf_fwd_s: float
    ours_fwdbwd_s: float
    hf_fwdbwd_s: float

    @property
    def fwd_ratio(self) -> float:
        return self.hf_fwd_s / self.ours_fwd_s

    @property
    def fwdbwd_ratio(self) -> float:
        return self.hf_fwdbwd_s / self.ours_fwdbwd_s

    def to_dict(self) -> dict:
        return {**asdict(self), "fwd_ratio_hf_over_ours": self.fwd_ratio,
                "fwdbwd_ratio_hf_over_ours": self.fwdbwd_ratio}

    def table_row(self) -> str:
        return (f"{self.arch:<10} {self.part:<10} {self.tokens:>6} {self.max_abs_diff:>10.2e} "
                f"{self.ours_fwd_s * 1e3:>7.1f}ms {self.hf_fwd_s * 1e3:>7.1f}ms {self.fwd_ratio:>7.2f} "
                f"{self.ours_fwdbwd_s * 1e3:>7.1f}ms {self.hf_fwdbwd_s * 1e3:>7.1f}ms {self.fwdbwd_ratio:>7.2f}")


TABLE_HEADER = (f"{'arch':<10} {'part':<10} {'tokens':>6} {'max|diff|':>10} {'fwd ours':>9} {'fwd HF':>9} "
                f"{'HF/ours':>7} {'f+b ours':>9} {'f+b HF':>9} {'HF/ours':>7}")
TOLERANCE = 1e-4  # largest output difference that counts as "the same model"


def write_rows(rows: list[dict], out: str | Path) -> Path:
    """``moe_bench.json`` in the folder ``out``: the ``to_dict`` rows, the machine they ran on
    (``device.machine()``: CPU model and flags, bf16 support, torch) and the thread count."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine(), "threads": torch.get_num_threads(), "rows": rows}
    write_text(path / "moe_bench.json", json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return path / "moe_bench.json"


def compare(arch: str = "olmoe", preset: str = "small", n_layers: int | None = 2, batch: int = 2,
            seq_len: int = 512, repeats: int = 5, hf_experts: str | None = None,
            seed: int = 0) -> list[Comparison]:
    """Outputs and timings of our MoE block and model vs Hugging Face at identical weights."""
    cfg = our_config(arch, preset, n_layers)
    torch.manual_seed(seed)
    ours = build_model(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights so a mis-copied norm cannot go unnoticed
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    hf = hf_model(cfg, arch, hf_experts).eval()
    copy_weights(ours, hf)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    x = torch.randn(batch * seq_len, cfg.d_model, generator=g)
    out = []

    blk, hblk = ours.layers[0].moe, hf.model.layers[0].mlp
    with torch.no_grad():
        diff = (blk(x)[0] - hblk(x[None]).reshape_as(x)).abs().max().item()
        of, hff = _time_pair(lambda: blk(x), lambda: hblk(x[None]), repeats)
    ob, hb = _time_pair(_fwd_bwd(blk, lambda: blk(x)[0]), _fwd_bwd(hblk, lambda: hblk(x[None])), repeats)
    out.append(Comparison(arch, "moe_block", x.shape[0], diff, of, hff, ob, hb))

    with torch.no_grad():
        diff = (ours(ids).logits - hf(input_ids=ids).logits).abs().max().item()
        of, hff = _time_pair(lambda: ours(ids), lambda: hf(input_ids=ids), repeats)
    ob, hb = _time_pair(_fwd_bwd(ours, lambda: ours(ids).logits),
                        _fwd_bwd(hf, lambda: hf(input_ids=ids).logits), repeats)
    out.append(Comparison(arch, "model", ids.numel(), diff, of, hff, ob, hb))
    return out

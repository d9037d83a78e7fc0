"""Compute-matching solver: the ConceptMoE that spends what a MoE baseline spends (CONCEPTMOE.md §3).

Given a baseline MoE config, a compression ratio R and a reinvestment strategy, search a small
integer grid for the ConceptMoE whose activated FLOPs per token and total parameters both match
the baseline's (error = max(|flops_ratio − 1|, |params_ratio − 1|)):

- ``topk``: more activated experts in the concept model (``concept_top_k``); the concept
  layers may drop a few experts (``concept_n_experts``) to pay for the chunk and joint-decoding
  parameters.
- ``layers``: more concept layers (x·L), each with fewer experts so total parameters stay put.
- ``loop``: run the concept layers ``concept_loops`` times (more FLOPs, no new parameters).

The token-rate layers (encoder, decoder) may move their top-k by up to 2 to fine-tune FLOPs
when a concept-model expert step is too coarse. When they do, it shows: the name gains
``-tokentop<k>`` (the config's ``extra["base_top_k"]`` keeps the baseline's) and ``to_dict``
gains ``"token_top_k": {"baseline": .., "matched": ..}``; when they do not, neither appears. Candidates are ranked by error bucket (within
1%, 2%, 3%), then by how far the token and then the concept top-k move from the baseline's, then by the
loop count, then by error. The encoder/decoder split comes from the baseline
config's ``n_encoder_layers`` / ``n_decoder_layers``.

``experts_multiple_of`` N (``--experts-multiple-of``; under torchrun the expert-parallel degree):
only concept-model expert counts that N divides are candidates, so expert parallelism over N
processes can shard every layer (the small preset's unconstrained match has 29 concept experts);
the result records what the constraint cost in matching error (``MatchResult.constraint``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import UserError
from .config import ModelConfig
from .flops import count_flops

STRATEGIES = ("topk", "layers", "loop")
TOLERANCE = 0.03  # the contract: both ratios within 3% of 1
PICK_TOL = 0.01


@dataclass
class MatchResult:
    config: ModelConfig
    name: str
    flops_ratio: float
    params_ratio: float
    baseline: dict
    matched: dict
    # with experts_multiple_of > 1: {"experts_multiple_of": N, "error": this match's error,
    # "unconstrained_error": the best error without the constraint} (the cost of shardability)
    constraint: dict | None = None

    @property
    def error(self) -> float:
        return max(abs(self.flops_ratio - 1), abs(self.params_ratio - 1))

    def to_dict(self) -> dict:
        out = {"name": self.name, "strategy": self.config.extra.get("strategy"),
               "flops_ratio": self.flops_ratio, "params_ratio": self.params_ratio,
               "config": self.config.to_dict(), "baseline_flops": self.baseline, "flops": self.matched}
        base_k = self.config.extra.get("base_top_k")
        if base_k is not None and base_k != self.config.top_k:
            out["token_top_k"] = {"baseline": base_k, "matched": self.config.top_k}
        if self.constraint is not None:
            out["constraint"] = self.constraint
        return out


def _concept_experts(lo: int, E: int, multiple: int) -> list[int]:
    """Concept-model expert counts from ``lo`` to E that ``multiple`` divides; with a constraint
    the range reaches down to the next multiple below ``lo`` (E itself is always one)."""
    lo = lo // multiple * multiple if multiple > 1 else lo
    return [ce for ce in range(max(lo, 1), E + 1) if ce % multiple == 0]


def _candidates(base: ModelConfig, strategy: str, multiple: int = 1) -> Iterator[dict]:
    E, k, Lc = base.n_experts, base.top_k, base.n_concept_layers - base.n_encoder_layers - base.n_decoder_layers
    token_k = range(max(1, k - 2), min(E, k + 2) + 1)  # fine-tunes FLOPs at token rate
    if strategy == "topk":
        for ce in _concept_experts(max(k, E - max(4, E // 8)), E, multiple):
            for ck in range(1, ce + 1):
                for tk in token_k:
                    yield {"concept_n_experts": ce, "concept_top_k": ck, "top_k": tk}
    elif strategy == "layers":
        layer_counts = sorted({round(Lc * m) for m in (1.25, 1.5, 1.75, 2, 2.25, 2.5, 3, 4)} - {Lc})
        for lc in layer_counts:
            for ce in _concept_experts(1, E, multiple):
                for ck in range(1, ce + 1):
                    yield {"n_layers": base.n_encoder_layers + base.n_decoder_layers + lc,
                           "concept_n_experts": ce, "concept_top_k": ck}
    elif strategy == "loop":
        for loops in range(2, 9):
            for ce in _concept_experts(max(k, E - max(4, E // 8)), E, multiple):
                for ck in range(1, ce + 1):
                    for tk in token_k:
                        yield {"concept_loops": loops, "concept_n_experts": ce,
                               "concept_top_k": ck, "top_k": tk}
    else:
        raise UserError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")


def match_config(baseline: ModelConfig, ratio: float, strategy: str = "topk",
                 seq_len: int = 2048, tolerance: float = TOLERANCE, experts_multiple_of: int = 1) -> MatchResult:
    """The compute- and parameter-matched ConceptMoE for a MoE ``baseline`` at ratio R, with a
    concept-model expert count that ``experts_multiple_of`` divides (see the module doc)."""
    N = experts_multiple_of
    if not isinstance(N, int) or N < 1:
        raise UserError(f"--experts-multiple-of must be a positive integer (got {N!r})")
    if baseline.n_experts % N:
        raise UserError(f"--experts-multiple-of {N}: the baseline's token-rate layers have {baseline.n_experts} "
                        f"experts, which {N} does not divide")
    if N > 1:
        free = _match(baseline, ratio, strategy, seq_len, float("inf"), 1)
        res = _match(baseline, ratio, strategy, seq_len, tolerance, N)
        res.constraint = {"experts_multiple_of": N, "error": res.error, "unconstrained_error": free.error}
        return res
    return _match(baseline, ratio, strategy, seq_len, tolerance, 1)


def _match(baseline: ModelConfig, ratio: float, strategy: str, seq_len: int, tolerance: float,
           multiple: int) -> MatchResult:
    if strategy not in STRATEGIES:
        raise UserError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if not ratio > 1:
        raise UserError(f"--ratio must be > 1 for ConceptMoE (got {ratio})")
    base = baseline.replace(kind="moe") if baseline.is_concept else baseline
    if base.n_layers - base.n_encoder_layers - base.n_decoder_layers < 1:
        raise UserError("baseline has too few layers to split into encoder, concept model and decoder")
    ref = count_flops(base, seq_len)
    start = base.to_dict()
    lc_base = base.n_layers - base.n_encoder_layers - base.n_decoder_layers
    start.update(kind="conceptmoe", compression_ratio=float(ratio), concept_loops=1,
                 concept_n_experts=None, concept_top_k=None,
                 extra={**base.extra, "base_concept_layers": lc_base, "strategy": strategy})
    best = None
    for over in _candidates(base, strategy, multiple):
        cfg = ModelConfig.from_dict({**start, **over})
        f = count_flops(cfg, seq_len)
        fr = f["activated_flops_per_token"] / ref["activated_flops_per_token"]
        pr = f["total_params"] / ref["total_params"]
        err = max(abs(fr - 1), abs(pr - 1))
        # Prefer: error bucket (1%, 2%, 3%, worse), then the paper's knobs closest to baseline.
        bucket = min(int(err / PICK_TOL - 1e-9), 3)
        key = (bucket, abs(cfg.top_k - base.top_k), abs(cfg.concept_k - base.top_k),
               cfg.concept_loops, err)
        if best is None or key < best[0]:
            best = (key, cfg, f, fr, pr)
    _, cfg, f, fr, pr = best
    if cfg.top_k != base.top_k:  # the token-rate top-k moved: say so in the name and the JSON
        cfg = cfg.replace(extra={**cfg.extra, "base_top_k": base.top_k})
    if max(abs(fr - 1), abs(pr - 1)) > tolerance:
        within = f" with a multiple of {multiple} concept experts (--experts-multiple-of)" if multiple > 1 else ""
        raise UserError(f"no {strategy} config at R={ratio:g}{within} matches the baseline within "
                        f"{tolerance:.0%} (best: flops x{fr:.3f}, params x{pr:.3f})")
    return MatchResult(cfg, cfg.name, fr, pr, ref, f)

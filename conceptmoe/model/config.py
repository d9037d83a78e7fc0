"""Model configuration: one typed dataclass for both the MoE baseline and ConceptMoE.

Implements the knobs of CONCEPTMOE.md sections 2, 2b and 3. A plain MoE is a single stack
of ``n_layers`` blocks. A ConceptMoE splits the same ``n_layers`` into three stages:
``n_encoder_layers`` (token rate), ``n_layers - n_encoder_layers - n_decoder_layers`` concept
layers (concept rate, optionally looped ``concept_loops`` times) and ``n_decoder_layers``
(token rate, with joint decoding). The concept model may use its own expert count and top-k
(``concept_n_experts``, ``concept_top_k``): this is how compute saved by compression is
reinvested (section 3).

Presets are small named functions; ``ModelConfig.from_preset(name, **overrides)`` picks one.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("moe", "conceptmoe")
CHUNK_ROUTERS = ("cosine", "linear", "fixed")
CONCEPT_POOLING = ("boundary", "mean")
DECHUNK_SOURCES = ("output", "update")
# Fields added after runs were stored: written by ``to_dict`` only when they differ from these
# defaults, so configs stored before they existed still compare equal (``--resume``, ``compare``
# reuse) and the JSON of every config that does not use them stays byte-identical.
LATE_DEFAULTS = {"dechunk_source": "output", "joint_layers": None, "image_size": 0, "image_channels": 1,
                 "patch_size": 2, "image_token_id": 0, "image_compression_ratio": None, "attn_bias": "none",
                 "elastic_ratios": None, "ratio_embedding": "router", "boundary_sharpness_final": None,
                 "router_temperature": "none", "stage_norms": False, "stage_skip": False}
QK_NORMS = ("none", "head", "full")
RATIO_EMBEDDINGS = ("shift", "router", "router+concept")  # model/elastic.py
ROUTER_TEMPERATURES = ("none", "learned")  # model/chunking.py
ATTN_BIASES = ("none", "qkv", "qkvo")


@dataclass
class ModelConfig:
    """Architecture of a MoE or ConceptMoE language model (see CONCEPTMOE.md §2)."""

    kind: str = "conceptmoe"  # "moe" (baseline) or "conceptmoe"
    vocab_size: int = 4096
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 4  # grouped-query attention when < n_heads
    n_layers: int = 8  # total blocks (encoder + concept + decoder for ConceptMoE)
    head_size: int = 0  # per-head dimension; 0: d_model // n_heads (Qwen3-MoE sets its own)
    # --- MoE feed-forward (§2b) ---
    n_experts: int = 32
    top_k: int = 4
    expert_hidden: int = 128  # hidden size of each fine-grained SwiGLU expert
    n_shared_experts: int = 0
    shared_hidden: int = 0  # hidden size of each shared expert (0: same as expert_hidden)
    shared_expert_gate: bool = False  # Qwen-MoE style sigmoid gate on the shared expert
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    balance_loss_weight: float = 0.01
    router_z_loss_weight: float = 0.001
    # --- attention ---
    qk_norm: str = "none"  # "none", "head" (Qwen3-MoE) or "full" (OLMoE)
    # Attention biases: "qkv" (Qwen2-MoE's qkv_bias) or "qkvo" (OLMoE / Qwen3-MoE attention_bias); never on W'.
    attn_bias: str = "none"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # --- ConceptMoE (§2, §3) ---
    n_encoder_layers: int = 2
    n_decoder_layers: int = 2
    compression_ratio: float = 2.0  # target R (tokens per concept)
    chunk_router: str = "cosine"  # "cosine" (paper), "linear" or "fixed" (ablations)
    boundary_noise: bool = True  # Bernoulli(sharpen(p)) boundaries while training
    boundary_sharpness: float = 6.0
    # Anneal the training-time sharpness linearly from boundary_sharpness (step 0) to this at the
    # last step (None: constant): boundary samples move towards the hard eval decision p >= 0.5.
    boundary_sharpness_final: float | None = None
    # "learned": the cosine router's p becomes sigmoid(exp(a) · logit(p)) with a learned scalar a
    # (starting at 0, the paper's router): a learned inverse temperature (model/chunking.py).
    router_temperature: str = "none"
    ratio_loss_weight: float = 0.03
    # Weight of a confidence term, mean of 4·p·(1 - p) over positions after the first: 1 at
    # p = 0.5, 0 at p in {0, 1}, so it pushes the router away from the threshold (0: off).
    router_confidence_weight: float = 0.0
    # The fraction of the optimizer steps during which the confidence term is off (0: on from the
    # first step); from there it has its full weight: the router first learns where to cut, then
    # is pushed to decide (chunking.confidence_weight_at).
    router_confidence_start: float = 0.0
    concept_pooling: str = "boundary"  # "boundary": c_j = h at boundary; "mean": mean since last
    joint_decoding: bool = True
    joint_layers: int | None = None  # joint decoding in the last K decoder layers (None: all of them)
    # What the dechunk EMA carries: "output" = the concept model's output c_out (reference), or
    # "update" = c_out - c_in, so that h_t + z reproduces a plain MoE exactly when every token is a
    # concept with p = 1 (a converted MoE starts where it was; see interop/convert.py).
    dechunk_source: str = "output"
    concept_loops: int = 1  # run the concept-model layers this many times
    stage_norms: bool = False  # H-Net's stage norms: RMSNorm on the encoder's and the concept stack's outputs
    stage_skip: bool = False  # + W ĥ (W zero at init) beside the identity skip around the concept stack
    concept_n_experts: int | None = None  # None: same as n_experts
    concept_top_k: int | None = None  # None: same as top_k
    # --- images in the sequence (model/vision.py; 0: text-only) ---
    image_size: int = 0  # square images of image_size x image_size pixels
    image_channels: int = 1
    patch_size: int = 2  # P x P pixel patches, one sequence position each
    image_token_id: int = 0  # placeholder token: n_patches of them in input_ids per image
    image_compression_ratio: float | None = None  # own target R for image positions (None: one R for all)
    # --- elastic compression (model/elastic.py; None: one fixed R) ---
    # The trained ratios: each training sequence draws its target R from them, and any R in
    # [min, max] can be asked for at inference; compression_ratio is then the design ratio
    # (compute matching, FLOPs reports, the default R at inference).
    elastic_ratios: list[float] | None = None
    # How R reaches the model: "shift" (threshold only), "router" (+ a vector into the router's
    # input) or "router+concept" (+ a vector into the concept layers); "router" trained best in
    # the tiny measurements of issue 21 (notes), the study at the small preset decides.
    ratio_embedding: str = "router"
    extra: dict[str, Any] = field(default_factory=dict)  # free-form metadata (e.g. preset name)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"ModelConfig.{name}: {why} (got {getattr(self, name)!r})")

        if self.kind not in KINDS:
            bad("kind", f"must be one of {KINDS}")
        for name in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "n_layers", "n_experts",
                     "top_k", "expert_hidden", "concept_loops"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be a positive integer")
        if not isinstance(self.head_size, int) or self.head_size < 0:
            bad("head_size", "must be an integer >= 0 (0: d_model // n_heads)")
        if not self.head_size and self.d_model % self.n_heads:
            bad("d_model", f"must be divisible by n_heads={self.n_heads} (or set head_size)")
        if self.n_heads % self.n_kv_heads:
            bad("n_kv_heads", f"must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            bad("head_size" if self.head_size else "d_model", "head dimension must be even for RoPE")
        if self.top_k > self.n_experts:
            bad("top_k", f"must be <= n_experts={self.n_experts}")
        if self.n_shared_experts < 0 or self.shared_hidden < 0:
            bad("n_shared_experts", "shared expert count and size must be >= 0")
        if self.qk_norm not in QK_NORMS:
            bad("qk_norm", f"must be one of {QK_NORMS}")
        if self.attn_bias not in ATTN_BIASES:
            bad("attn_bias", f"must be one of {ATTN_BIASES}")
        for name in ("balance_loss_weight", "router_z_loss_weight", "ratio_loss_weight", "router_confidence_weight"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        if not 0 <= self.router_confidence_start < 1:
            bad("router_confidence_start", "must be a fraction of the training steps in [0, 1)")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            bad("rope_theta", "rope_theta and norm_eps must be > 0")
        self._check_images(bad)
        if self.kind == "moe":
            if self.elastic_ratios is not None:
                bad("elastic_ratios", "elastic ratios train a ConceptMoE; a plain MoE has no concepts")
            return
        if not (self.compression_ratio > 1 or (self.compression_ratio == 1 and self.chunk_router == "fixed")):
            bad("compression_ratio", "ConceptMoE needs R > 1 (R = 1 only with chunk_router='fixed')")
        if self.chunk_router not in CHUNK_ROUTERS:
            bad("chunk_router", f"must be one of {CHUNK_ROUTERS}")
        if self.concept_pooling not in CONCEPT_POOLING:
            bad("concept_pooling", f"must be one of {CONCEPT_POOLING}")
        if self.dechunk_source not in DECHUNK_SOURCES:
            bad("dechunk_source", f"must be one of {DECHUNK_SOURCES}")
        if self.joint_layers is not None and not (isinstance(self.joint_layers, int)
                                                  and 0 <= self.joint_layers <= self.n_decoder_layers):
            bad("joint_layers", f"must be None or an integer in [0, n_decoder_layers={self.n_decoder_layers}]")
        if self.boundary_sharpness < 1:
            bad("boundary_sharpness", "must be >= 1")
        if self.boundary_sharpness_final is not None and not self.boundary_sharpness_final >= 1:
            bad("boundary_sharpness_final", "must be None or >= 1")
        if self.router_temperature not in ROUTER_TEMPERATURES:
            bad("router_temperature", f"must be one of {ROUTER_TEMPERATURES}")
        if self.router_temperature == "learned" and self.chunk_router != "cosine":
            bad("router_temperature", "a learned temperature needs chunk_router='cosine'")
        if self.n_encoder_layers < 1 or self.n_decoder_layers < 1:
            bad("n_encoder_layers", "encoder and decoder need at least one layer each")
        if self.n_concept_layers < 1:
            bad("n_layers", "must leave at least one concept layer after encoder and decoder")
        if self.concept_n_experts is not None and self.concept_n_experts < 1:
            bad("concept_n_experts", "must be a positive integer or None")
        if self.concept_top_k is not None and not 1 <= self.concept_top_k <= self.concept_experts:
            bad("concept_top_k", f"must be in [1, concept experts={self.concept_experts}]")
        self._check_elastic(bad)

    def _check_elastic(self, bad) -> None:
        if self.ratio_embedding not in RATIO_EMBEDDINGS:
            bad("ratio_embedding", f"must be one of {RATIO_EMBEDDINGS}")
        rs = self.elastic_ratios
        if rs is None:
            return
        from .elastic import ratio_set_problem  # the one rule of every path; lazy: config imports no torch
        why = ratio_set_problem(rs)
        if why:
            bad("elastic_ratios", why)
        if not rs[0] <= self.compression_ratio <= rs[-1]:
            bad("compression_ratio", f"the design ratio must lie in the trained range [{rs[0]:g}, {rs[-1]:g}]")
        if self.chunk_router == "fixed" or self.image_size:
            bad("elastic_ratios", "needs a learned router (cosine or linear) and a text-only model")

    def _check_images(self, bad) -> None:
        if not isinstance(self.image_size, int) or self.image_size < 0:
            bad("image_size", "must be an integer >= 0 (0: text-only)")
        if self.image_compression_ratio is not None and not (self.image_size and self.image_compression_ratio > 1):
            bad("image_compression_ratio", "must be None or > 1, and needs image_size > 0")
        if not self.image_size:
            return
        if not isinstance(self.patch_size, int) or self.patch_size < 1 or self.image_size % self.patch_size:
            bad("patch_size", f"must be a positive integer dividing image_size={self.image_size}")
        if not isinstance(self.image_channels, int) or self.image_channels < 1:
            bad("image_channels", "must be a positive integer")
        if not 0 <= self.image_token_id < self.vocab_size:
            bad("image_token_id", f"must be a token id in [0, vocab_size={self.vocab_size})")

    # ----- derived sizes -----
    @property
    def n_patches(self) -> int:
        """Sequence positions per image (0 for a text-only model)."""
        return (self.image_size // self.patch_size) ** 2 if self.image_size else 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def is_concept(self) -> bool:
        return self.kind == "conceptmoe"

    @property
    def n_concept_layers(self) -> int:
        if not self.is_concept:
            return self.n_layers
        return self.n_layers - self.n_encoder_layers - self.n_decoder_layers

    @property
    def n_joint_layers(self) -> int:
        """Decoder layers with joint decoding: the last ``joint_layers`` (None: all)."""
        if not self.is_concept or not self.joint_decoding:
            return 0
        return self.n_decoder_layers if self.joint_layers is None else self.joint_layers

    @property
    def concept_experts(self) -> int:
        return self.concept_n_experts or self.n_experts

    @property
    def concept_k(self) -> int:
        return self.concept_top_k or self.top_k

    @property
    def shared_size(self) -> int:
        return self.shared_hidden or self.expert_hidden

    @property
    def name(self) -> str:
        """Paper-style name ``ConceptMoE-xL[-loopn]-topy[-tokentopk]-Rz``.

        x = concept layers x loops / the baseline's concept layers; ``-loopn`` when the concept
        layers run n > 1 times (so "more layers" and "looping" never share a name);
        ``-tokentopk`` when the token-rate layers' top-k differs from the baseline's
        (``extra["base_top_k"]``, set by ``match_config`` only when it moved that top-k).
        """
        if not self.is_concept:
            return f"MoE-top{self.top_k}"
        base = self.extra.get("base_concept_layers", self.n_concept_layers)
        mult = round(self.n_concept_layers * self.concept_loops / base, 2)
        loop = f"-loop{self.concept_loops}" if self.concept_loops > 1 else ""
        base_k = self.extra.get("base_top_k", self.top_k)
        token_k = f"-tokentop{self.top_k}" if base_k != self.top_k else ""
        elastic = f"-elastic{self.elastic_ratios[0]:g}-{self.elastic_ratios[-1]:g}" if self.elastic_ratios else ""
        return f"ConceptMoE-{mult:g}L{loop}-top{self.concept_k}{token_k}-R{self.compression_ratio:g}{elastic}"

    # ----- (de)serialisation -----
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name, default in LATE_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}")
        return cls(**d)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "ModelConfig":
        p = Path(text_or_path) if not str(text_or_path).lstrip().startswith("{") else None
        return cls.from_dict(json.loads(p.read_text() if p is not None else str(text_or_path)))

    def replace(self, **overrides: Any) -> "ModelConfig":
        return self.from_dict({**self.to_dict(), **overrides})

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        base = PRESETS[name]().to_dict()
        base["extra"] = {**base.get("extra", {}), "preset": name}
        return cls.from_dict({**base, **overrides})


def tiny() -> ModelConfig:
    """Unit-test size: a forward pass takes milliseconds on CPU."""
    return ModelConfig(vocab_size=256, d_model=32, n_heads=4, n_kv_heads=2, n_layers=4,
                       n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1,
                       n_encoder_layers=1, n_decoder_layers=1)


def small() -> ModelConfig:
    """Default CPU training model: fine-grained MoE, 8 layers (2 + 4 + 2 for ConceptMoE).

    Two token-rate layers on each side, not one: with 1 + 6 + 1 the compute-matched ConceptMoE never
    learned in-context copying (induction needs two token-level attention layers) and fell 0.20 BPB
    behind the MoE at 9.6M tokens on code; 2 + 4 + 2 copies, its gap there unresolved (3 seeds, fp32:
    the README's quality table); its KV cache is 0.75x the MoE's, not 0.625x.

    Three settings differ from CONCEPTMOE.md, from the studies in docs/study/report.md and
    docs/study-elastic/README.md: ratio-loss weight 0.5, not the paper's 0.03 (the ratio loss acts
    like a proportional controller whose steady-state error scales with 1/weight: 0.03 ends 20%
    above R in short runs); boundary sharpness 1 at the start (training samples Bernoulli(p)
    itself), which trained a better model than s = 6 on all three seeds at 300k tokens; annealed
    linearly to 8 at the last step, without which the held-out compression (cut at p >= 0.5) missed
    every R but 2 (R = 4 realised 22-46 at 1.2M tokens; annealed: 4.3-4.9).
    """
    return ModelConfig(vocab_size=4096, d_model=256, n_heads=4, n_kv_heads=4, n_layers=8, n_experts=32, top_k=4,
                       expert_hidden=64, n_shared_experts=1, shared_hidden=128, n_encoder_layers=2,
                       n_decoder_layers=2, ratio_loss_weight=0.5, boundary_sharpness=1.0, boundary_sharpness_final=8.0)


def paper() -> ModelConfig:
    """Paper-scale config used for FLOPs tables only (27 layers = 2 + 23 + 2, 64 experts top-8)."""
    return ModelConfig(vocab_size=50304, d_model=2048, n_heads=16, n_kv_heads=4, n_layers=27,
                       n_experts=64, top_k=8, expert_hidden=1024, n_shared_experts=0,
                       qk_norm="full", n_encoder_layers=2, n_decoder_layers=2)


def vlm() -> ModelConfig:
    """Vision-language CPU model for the digits task (data/digits.py): 8x8 images in 4x4
    patches (4 positions per image), a 64-entry word vocabulary, 6 layers (1 + 4 + 1)."""
    return ModelConfig(vocab_size=64, d_model=128, n_heads=4, n_kv_heads=4, n_layers=6,
                       n_experts=16, top_k=2, expert_hidden=64, n_shared_experts=1,
                       n_encoder_layers=1, n_decoder_layers=1, ratio_loss_weight=0.5,
                       image_size=8, patch_size=4, image_token_id=1)


PRESETS = {"tiny": tiny, "small": small, "paper": paper, "vlm": vlm}


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """Parse ``key=value`` strings (CLI ``--set``) into typed ModelConfig overrides."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    out: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        key = key.strip()
        if key not in fields or key == "extra":
            raise ValueError(f"--set: unknown model field {key!r}")
        default = getattr(ModelConfig(kind="moe"), key)
        out[key] = _coerce(key, raw.strip(), default)
    return out


NULLABLE = ("concept_n_experts", "concept_top_k", "joint_layers")  # int or None
FLOAT_NULLABLE = ("image_compression_ratio", "boundary_sharpness_final")  # float or None


def _coerce(key: str, raw: str, default: Any) -> Any:
    if key == "elastic_ratios":  # a comma list of ratios, or none
        try:
            return None if raw.lower() in ("none", "null") else [float(r) for r in raw.split(",")]
        except ValueError:
            raise ValueError(f"--set elastic_ratios: cannot parse {raw!r} as ratios like 1.5,2,3,4") from None
    if raw.lower() in ("none", "null") and key in NULLABLE + FLOAT_NULLABLE:
        return None
    try:
        if key in FLOAT_NULLABLE:
            return float(raw)
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, int) or key in NULLABLE:
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise ValueError(f"--set {key}: cannot parse {raw!r} as {type(default).__name__}") from None
    return raw

"""``TrainConfig``: what a training run is, and the ModelConfig it asks for (CONCEPTMOE.md §3, §5).

The model is ``ModelConfig.from_preset(preset)`` of the requested kind; with ``strategy`` it is
the ConceptMoE that ``match_config`` compute-matches to the preset's MoE baseline (§3).
``resolve_train_config`` turns the settings a user gave into a TrainConfig; with ``resume``
the ones left out come from the run's stored config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..model.config import ModelConfig
from ..model.match import MatchResult, match_config
from . import checkpoint as ck
from ..data.corpus import DEFAULT_CORPUS, TUNING_CORPUS
from ..data.recipes import RECIPES
from .elastic import parse_ratios
from .init_run import check_new_ratios, resolve_init
from ..data.digits import VLM_DATA

DEFAULT_TOKENS = 1_600_000  # `conceptmoe train` with no flags: 680 s on 2 AMX cores in bf16
STRATEGIES = ("topk", "layers", "loop")
DEFAULT_STRATEGY = "topk"  # what `conceptmoe train` matches a ConceptMoE by when --strategy is not given
MAX_RATIO = 64  # tokens per concept; the paper uses 1.5-4
MAX_SEED = 2**32 - 1  # seeds are mixed with step counts into 64-bit generator seeds (loop.py, corpus.py)
# ConceptMoE fields that do not change the compute match: re-applied after matching.
CONCEPT_ONLY = ("chunk_router", "boundary_noise", "boundary_sharpness", "boundary_sharpness_final",
                "router_temperature", "ratio_loss_weight", "router_confidence_weight",
                "router_confidence_start", "concept_pooling", "joint_decoding", "elastic_ratios", "ratio_embedding")
# Fields a plain MoE ignores (its run config leaves them at the preset's values).
MOE_IGNORED = CONCEPT_ONLY + ("n_encoder_layers", "n_decoder_layers", "compression_ratio",
                              "concept_loops", "concept_n_experts", "concept_top_k", "stage_norms", "stage_skip")
LOG_MODES = ("jsonl", "tensorboard")  # --log: what watching a run writes besides the plain metrics rows
# Changing these on --resume would make a different run.
RUN_IDENTITY = ("data", "batch_size", "seq_len", "seed", "ratios")
# What a resumed run keeps of its optimizer's settings: the lr schedule (peak, warmup, floor) and
# the groups' decay and router multiplier (which the checkpointed optimizer state restores anyway).
RUN_SCHEDULE = ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "chunk_lr_mult", "stage_lr_mults")


# The peak learning rate when --lr is not given, by model kind. The ConceptMoE's is half the MoE's:
# at 2e-3 its training stalls (gradient norms 4-5) and it ends 0.24 BPB behind the MoE at 4.8M
# tokens; at 1e-3 it keeps pace. The MoE is better at 2e-3 (docs/study/round2/README.md).
DEFAULT_LR = {"moe": 2e-3, "conceptmoe": 1e-3}


@dataclass
class TrainConfig:
    """Everything a training run needs besides the data itself (stored in config.json)."""

    model: str = "conceptmoe"  # "conceptmoe" or "moe"
    preset: str = "small"
    ratio: float = 2.0  # target compression R (ConceptMoE); with ``ratios``: the design ratio
    # Elastic training (training/elastic.py): [[R, weight], ...], each sequence draws its R (--ratios)
    ratios: list[list[float]] | None = None
    strategy: str | None = None  # "topk" | "layers" | "loop": compute-matched to the MoE preset
    overrides: dict[str, Any] = field(default_factory=dict)  # --set key=value
    data: str | None = None  # None: the Shakespeare corpus
    out: str | None = None  # None: runs/<preset>-<model name>
    max_steps: int | None = None  # None: from tokens (default DEFAULT_TOKENS)
    tokens: int | None = None
    save_every: int = 100
    batch_size: int = 8
    seq_len: int = 256
    lr: float | None = None  # None: DEFAULT_LR of the model kind
    warmup_steps: int | None = None  # None: 5% of the steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chunk_lr_mult: float = 1.0  # learning-rate multiplier of the chunk router
    # Per-stage learning rates (ConceptMoE): [token-rate stage, concept stage] multipliers of lr, or
    # "auto" (``stage_lr_rule``); None: one rate for the whole model, as before they existed.
    stage_lr_mults: list[float] | str | None = None
    seed: int = 0
    device: str = "auto"
    eval_every: int | None = None  # None: ~10 validations per run; 0: none
    eval_tokens: int = 32768  # size of the held-out slice validated during training
    val_tokens: int | None = 1_000_000  # cap on the final validation (None: all held-out text)
    skip_bad_steps: int = 0  # steps with a non-finite loss/gradient to skip before stopping
    parallel: str | None = None  # "ddp" | "fsdp" under torchrun (default ddp)
    grad_accum: int = 1  # micro-batches per optimizer step (per process)
    dtype: str | None = None  # "fp32" | "bf16" (default: device.default_dtype)
    compile: bool = False  # torch.compile each block
    expert_parallel: int = 1  # processes sharing one layer's experts (torchrun)
    # --strategy: the matched ConceptMoE's concept experts a multiple of this (None: --expert-parallel)
    experts_multiple_of: int | None = None
    tokenizer: str | None = None  # reuse this tokenizer.json instead of training one
    init: str | None = None  # start from this run's weights, model config and tokenizer (continual training)
    init_model: dict[str, Any] | None = None  # the init run's model config, stored so that --resume needs only the run
    resume: bool = False
    force: bool = False
    progress: bool = True
    verify: bool = False  # check every prepared shard's SHA-256 before training (always done on --resume)
    # Watching a run (health.py): "jsonl" adds the router's and experts' health and warnings to
    # metrics.jsonl, "tensorboard" also writes them as TensorBoard events; None: the plain rows.
    log: str | None = None

    def __post_init__(self) -> None:
        if self.model not in ("conceptmoe", "moe"):
            raise UserError(f"--model must be conceptmoe or moe (got {self.model!r})")
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)} (got {self.strategy!r})")
        if self.strategy and self.model == "moe":
            raise UserError("--strategy builds a compute-matched ConceptMoE; it cannot be combined with --model moe")
        if self.max_steps is not None and self.tokens is not None:
            raise UserError("give --max-steps or --tokens, not both")
        if self.parallel is not None and self.parallel not in ("ddp", "fsdp"):
            raise UserError(f"--parallel must be ddp or fsdp (got {self.parallel!r})")
        if self.log is not None and self.log not in LOG_MODES:
            raise UserError(f"--log must be one of {', '.join(LOG_MODES)} (got {self.log!r})")
        if self.dtype is not None and self.dtype not in ("fp32", "bf16"):
            raise UserError(f"--dtype must be fp32 or bf16 (got {self.dtype!r})")
        for name in ("max_steps", "tokens", "save_every", "batch_size", "seq_len", "eval_tokens", "val_tokens",
                     "grad_accum", "expert_parallel", "experts_multiple_of"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer (got {v!r})")
        if self.parallel == "fsdp" and self.expert_parallel > 1:
            raise UserError("--expert-parallel combines with --parallel ddp, not fsdp")
        if self.experts_multiple_of is not None and not self.strategy:
            raise UserError("--experts-multiple-of constrains the compute-matched ConceptMoE (--strategy); "
                            "this run has no --strategy")
        if self.strategy and self.experts_multiple_of is None:  # shardable by this launch's expert parallelism
            self.experts_multiple_of = self.expert_parallel
        for name in ("warmup_steps", "eval_every", "skip_bad_steps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise UserError(f"--{name.replace('_', '-')} must be an integer >= 0 (got {v!r})")
        for name in ("lr", "ratio", "min_lr_ratio", "weight_decay", "grad_clip", "chunk_lr_mult"):
            v = getattr(self, name)
            if v is None and name == "lr":
                continue
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise UserError(f"--{name.replace('_', '-')} must be a finite number (got {v!r})")
        if self.seq_len < 2:
            raise UserError("--seq-len must be at least 2")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed must be an integer in [0, {MAX_SEED}] (got {self.seed!r})")
        if (self.lr is not None and not self.lr > 0) or self.grad_clip <= 0 or self.chunk_lr_mult < 0:
            raise UserError("--lr and grad_clip must be > 0 and chunk_lr_mult >= 0")
        if not 0 <= self.min_lr_ratio <= 1 or self.weight_decay < 0:
            raise UserError("min_lr_ratio must be in [0, 1] and weight_decay >= 0")
        if self.model == "conceptmoe" and not 1 < self.ratio <= MAX_RATIO:
            raise UserError(f"--ratio must be > 1 and <= {MAX_RATIO} (got {self.ratio:g})")
        self.ratios = parse_ratios(self.ratios)
        if self.ratios and self.model == "moe":
            raise UserError("--ratios trains an elastic ConceptMoE; it cannot be combined with --model moe")
        if self.ratios and "elastic_ratios" in self.overrides:
            raise UserError("--ratios and --set elastic_ratios both set the trained ratios: give one of them")
        self.data = resolve_data(self.data)  # stored resolved: resumable from anywhere
        if self.init is not None:
            if self.strategy:
                raise UserError("--init takes the model from the init run; it cannot be combined with --strategy")
            self.init, self.init_model = resolve_init(self.init, self.init_model)
            if self.out and Path(self.out).resolve() == Path(self.init):
                raise UserError("--init and --out must be different runs")
            self.model = self.init_model.get("kind", "conceptmoe")
            if self.init_model.get("image_size") and self.data != VLM_DATA:
                raise UserError(f"--init {self.init} is a vision-language run (word vocabulary, images): it "
                                f"continues only on --data {VLM_DATA}")
            self.tokenizer = self.tokenizer or str(Path(self.init) / "tokenizer.json")
            if self.ratios:
                check_new_ratios(self.init, self.init_model, [r for r, _ in self.ratios])
        self.stage_lr_mults = parse_stage_mults(self.stage_lr_mults, self.model, self.ratio)
        if self.lr is None:  # the kind is known now (--init brings its own)
            self.lr = DEFAULT_LR[self.model]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for transient in ("resume", "force", "progress", "verify"):
            d.pop(transient)
        if d["ratios"] is None:  # a fixed-R run's config stays as it was before --ratios existed
            del d["ratios"]
        if d["experts_multiple_of"] in (None, 1):  # likewise before --experts-multiple-of
            del d["experts_multiple_of"]
        if d["log"] is None:  # likewise before --log
            del d["log"]
        if d["stage_lr_mults"] is None:  # likewise before --stage-lr-mults
            del d["stage_lr_mults"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def total_steps(self) -> int:
        return schedule_steps(self.to_dict())


def stage_lr_rule(ratio: float) -> list[float]:
    """The default per-stage rule ("auto"): H-Net's learning-rate modulation (Hwang, Wang and Gu,
    arXiv 2507.07955, §2.3.3; goombalab/hnet sets a multiplier per stage, outer stages higher) as we
    read it: a stage's rate grows with the square root of the tokens it sees per batch and falls
    with the square root of its width. Both stages here are d_model wide and the concept stage sees
    1/R of the tokens: [1, 1/sqrt(R)] of the token-rate stage's lr."""
    return [1.0, round(1 / math.sqrt(ratio), 6)]


def parse_stage_mults(given, model: str, ratio: float) -> list[float] | None:
    """``--stage-lr-mults``: "auto", "TOKEN,CONCEPT" or a two-number list -> [token, concept]."""
    if given is None:
        return None
    if model != "conceptmoe":
        raise UserError("--stage-lr-mults sets a ConceptMoE's per-stage learning rates; a plain MoE has one stage")
    if isinstance(given, str) and given.strip().lower() == "auto":
        return stage_lr_rule(ratio)
    try:
        vals = [float(v) for v in (given.split(",") if isinstance(given, str) else given)]
    except (TypeError, ValueError):
        vals = []
    if len(vals) != 2 or not all(math.isfinite(v) and v >= 0 for v in vals) or not vals[0] > 0:
        raise UserError(f"--stage-lr-mults takes auto or TOKEN,CONCEPT: two finite multipliers of --lr, the "
                        f"token-rate stage's > 0, the concept stage's >= 0 (got {given!r})")
    return vals


def schedule_steps(train: dict[str, Any]) -> int:
    """The optimizer steps of a run (a stored or given train config): --max-steps, or --tokens
    (default DEFAULT_TOKENS) in global batches. The lr cosine, the boundary-sharpness anneal and
    the confidence term's start are laid out over them."""
    if train.get("max_steps") is not None:
        return train["max_steps"]
    return max(1, math.ceil((train.get("tokens") or DEFAULT_TOKENS) / (train["batch_size"] * train["seq_len"])))


def default_warmup(plan: int) -> int:
    """Warmup steps when --warmup-steps is not given: 5% of the steps the schedule is laid out over."""
    return max(1, plan // 20)


def default_eval_every(total: int) -> int:
    """Steps between validations when --eval-every is not given: ten per run."""
    return max(1, total // 10)


def comparable_model(model: dict[str, Any]) -> dict[str, Any]:
    """A stored model config as it decides a run: fields added since take their defaults, and a
    MoE's ConceptMoE-only fields (which it never uses, e.g. a preset's boundary sharpness) drop out."""
    d = ModelConfig.from_dict(model).to_dict()
    return {k: v for k, v in d.items() if k not in MOE_IGNORED} if d["kind"] == "moe" else d


def trained_as(stored: dict[str, Any], tc: TrainConfig) -> bool:
    """Whether a stored run config (config.json) was trained with the settings ``tc`` asks for:
    the same model (``comparable_model``) and training settings, not counting where, on what
    device or in what precision it ran (config.json records that: ``precision``); --set overrides
    count through the model config they give."""
    place = ("device", "out", "tokenizer", "overrides", "dtype", "log")
    train = lambda d: {k: v for k, v in d.items() if k not in place}  # noqa: E731
    return (comparable_model(stored["model"]) == comparable_model(model_config(tc).to_dict())
            and train(stored.get("train", {})) == train(tc.to_dict()))


def resolve_data(data: str | None) -> str | None:
    """An absolute --data path (the default corpus, the recipes and the digits task keep their names)."""
    named = (DEFAULT_CORPUS, TUNING_CORPUS, VLM_DATA) + RECIPES
    return data if data is None or str(data) in named else str(Path(data).resolve())


# ModelConfig's errors name its fields; the user gave flags (issue 41).
FIELD_FLAGS = {"compression_ratio": "--ratio", "elastic_ratios": "--ratios (or --set elastic_ratios)"}


def flag_error(e: Exception) -> UserError:
    """A ModelConfig error as a UserError that names the flag (``--ratio``, ``--set NAME``), not the field."""
    msg = str(e)
    if msg.startswith("ModelConfig."):
        name, rest = msg[len("ModelConfig."):].split(":", 1)
        msg = f"{FIELD_FLAGS.get(name, '--set ' + name)}:{rest}"
    return UserError(msg)


def model_config(tc: TrainConfig) -> ModelConfig:
    """The ModelConfig a TrainConfig asks for (preset, kind, R, matching strategy, --set)."""
    try:
        mc = _model_config(tc)
        if tc.ratios and mc.is_concept:
            mc = mc.replace(elastic_ratios=[r for r, _ in tc.ratios])
        return mc
    except (TypeError, ValueError) as e:
        raise flag_error(e) from None


def match_result(tc: TrainConfig) -> MatchResult:
    """The compute match of a --strategy run: the ConceptMoE matched to the preset's MoE (its
    constraint's cost in ``.constraint``). Ablation knobs change the ConceptMoE, not the baseline."""
    shared = {k: v for k, v in tc.overrides.items() if k not in CONCEPT_ONLY}
    base = ModelConfig.from_preset(tc.preset, **{**shared, "kind": "moe"})
    return match_config(base, tc.ratio, tc.strategy, experts_multiple_of=tc.experts_multiple_of or 1)


def _model_config(tc: TrainConfig) -> ModelConfig:
    try:
        if tc.init_model is not None:  # --init: the init run's model, with --set on top
            return ModelConfig.from_dict({**tc.init_model, **tc.overrides})
        if tc.strategy:
            mc = match_result(tc).config
            return mc.replace(**{k: v for k, v in tc.overrides.items() if k in CONCEPT_ONLY})
        kind = {"kind": tc.model}
        if tc.model == "conceptmoe":
            kind["compression_ratio"] = tc.ratio
        return ModelConfig.from_preset(tc.preset, **{**kind, **tc.overrides})
    except (TypeError, ValueError) as e:
        raise flag_error(e) from None


def default_out(tc: TrainConfig, mc: ModelConfig) -> Path:
    return Path("runs") / f"{tc.preset}-{mc.name}"


def resolve_train_config(given: dict[str, Any], resume: bool = False, force: bool = False) -> TrainConfig:
    """TrainConfig from the settings given; with ``resume``, the rest come from the stored run."""
    if resume:
        if force:
            raise UserError("--resume and --force contradict each other")
        probe = TrainConfig(**given)
        out = Path(given.get("out") or default_out(probe, model_config(probe)))
        if ck.is_run(out):
            stored = TrainConfig.from_dict(ck.read_run_config(out).get("train", {})).to_dict()
            if stored.get("strategy"):  # the constraint it was matched under, not this launch's default
                stored.setdefault("experts_multiple_of", 1)
            if "max_steps" in given or "tokens" in given:
                stored.pop("max_steps"), stored.pop("tokens")
            for launch in ("parallel", "expert_parallel"):  # chosen per launch, like the process count
                stored.pop(launch)
            given = {**stored, **given, "out": str(out)}
    return TrainConfig(**given, resume=resume, force=force)

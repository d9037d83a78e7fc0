"""TensorBoard event files of a run (``train --log tensorboard``): the metrics rows, tag by tag.

``torch.utils.tensorboard`` needs the ``tensorboard`` package, an optional extra
(``pip install -e ".[tensorboard]"``). Events go to RUN/tensorboard/; a resumed run appends to
them, purging the events after its checkpoint's step (the metrics rows it drops, too), so a
resumed step is not shown twice. ``scalars(row)`` is the one map from a metrics.jsonl row to
tags: what TensorBoard shows is what the JSONL holds.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..model.health import P_BINS

TB_DIR = "tensorboard"
INSTALL = 'pip install -e ".[tensorboard]"'
# metrics-row key -> tag, for the per-step scalars (present when the row has them)
STEP_TAGS = {"loss": "train/loss", "bpb": "train/bpb", "lr": "train/lr", "grad_norm": "train/grad_norm",
             "tokens_per_s": "train/tokens_per_s", "flops_per_s": "train/flops_per_s", "mfu": "train/mfu",
             "compression": "router/compression", "boundary_prob": "router/boundary_prob",
             "ratio_loss": "router/ratio_loss", "balance_loss": "experts/balance_loss",
             "router_z_loss": "experts/z_loss", "val_loss": "eval/loss", "val_bpb": "eval/bpb",
             "val_compression": "eval/compression"}


def require() -> None:
    """Refuse (one line) before a run starts when TensorBoard cannot be imported."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise UserError(f"--log tensorboard needs the tensorboard package: {INSTALL}") from None


def open_writer(out: Path, step: int):
    """A SummaryWriter on RUN/tensorboard/; from a resumed ``step``, later events are purged."""
    require()
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(Path(out) / TB_DIR), purge_step=step + 1 if step > 0 else None)


def scalars(row: dict) -> dict[str, float]:
    """Every scalar tag of a metrics row: the per-step figures and, at a health step, the
    chunk router's and every MoE layer's (``training/health.py``)."""
    out = {tag: float(row[k]) for k, tag in STEP_TAGS.items() if k in row}
    h = row.get("health") or {}
    for k in ("compression", "near_threshold", "target"):
        if k in h:
            out[f"router/interval_{k}"] = float(h[k])
    for r, c in (h.get("compression_by_ratio") or {}).items():
        out[f"router/compression_R{r}"] = float(c)
    for name, e in (h.get("experts") or {}).items():
        for k in ("imbalance", "dead", "z_loss"):
            out[f"experts/{name}/{k}"] = float(e[k])
    if "experts" in h:
        out["experts/dead"] = float(sum(e["dead"] for e in h["experts"].values()))
    return out


def write(writer, row: dict) -> None:
    """One metrics row as events at its step: scalars, and at a health step two histograms."""
    step = row["step"]
    _scalars(writer, scalars(row), step)
    h = row.get("health") or {}
    if "p_histogram" in h:  # p over [0, 1] in P_BINS equal bins
        _raw_histogram(writer, "router/p", [(i + 1) / P_BINS for i in range(P_BINS)], h["p_histogram"],
                       [(i + 0.5) / P_BINS for i in range(P_BINS)], step)
    for name, e in (h.get("experts") or {}).items():  # tokens over the expert index: the load
        E = len(e["tokens"])
        _raw_histogram(writer, f"experts/{name}/tokens", [i + 0.5 for i in range(E)], e["tokens"],
                       list(range(E)), step)
    for w in row.get("warnings", []):
        writer.add_text("warnings", w, step)
    if h:
        writer.flush()


def _scalars(writer, values: dict[str, float], step: int) -> None:
    """All the scalars of a step as one event: ~40 us, where ``add_scalar`` takes ~45 us per tag."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values.items()])
    writer._get_file_writer().add_summary(summary, step)


def _raw_histogram(writer, tag: str, limits: list[float], counts: list[int], centres: list[float], step: int) -> None:
    n = sum(counts)
    if n == 0:
        return
    filled = [i for i, c in enumerate(counts) if c]
    writer.add_histogram_raw(tag, min=centres[filled[0]], max=centres[filled[-1]], num=n,
                             sum=sum(c * x for c, x in zip(counts, centres)),
                             sum_squares=sum(c * x * x for c, x in zip(counts, centres)),
                             bucket_limits=limits, bucket_counts=counts, global_step=step)

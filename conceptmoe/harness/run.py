"""``evaluate_tasks``: lm-evaluation-harness tasks on a run (``conceptmoe eval RUN --tasks ...``, issue 11 B).

Builds the offline tasks (``tasks.py``) if needed, wraps the run in ``ConceptMoEHarnessLM``
(``lm.py``) and calls the harness's ``simple_evaluate`` with the task folder on its include path,
so stock task names work as well where their datasets are already in the local cache.
Returns ``{"results": {task: {metric: value}}, "groups": ..., "n_samples": ...}`` with the
harness's metric keys (``acc,none``, ``bits_per_byte,none``, ...) shortened to the metric name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import UserError
from .tasks import ensure_tasks


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("--tasks needs lm-evaluation-harness: pip install -e \".[eval]\"") from None
    return lm_eval, TaskManager


def _clean(block: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for task, metrics in block.items():
        row = {}
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if filt == "none" and not name.endswith("_stderr") and isinstance(value, (int, float)):
                row[name] = value if math.isfinite(value) else None
        out[task] = row
    return out


def evaluate_tasks(run: str | Path, tasks: list[str], limit: int | None = None, batch_size: int | None = None,
                   device: str = "auto", task_root: str | Path | None = None,
                   ratio: float | None = None, extrapolate: bool = False) -> dict[str, Any]:
    """Run harness ``tasks`` on ``run`` through our model directly; returns the cleaned results.
    ``ratio``: the R an elastic ConceptMoE runs at (``concept_ratio``; outside the trained range
    only with ``extrapolate``)."""
    lm_eval, TaskManager = _lm_eval()
    from .lm import ConceptMoEHarnessLM

    if not tasks:
        raise UserError("--tasks needs at least one task name")
    root = ensure_tasks(task_root)
    ours = all(t.startswith("cmoe_") for t in tasks)  # indexing the ~15k stock tasks takes ~10 s
    manager = TaskManager(include_path=str(root), include_defaults=not ours)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"unknown harness task(s) {unknown}; shipped: cmoe_nextline, cmoe_niah, "
                        f"cmoe_heldout_ppl (and cmoe_niah_05k/1k/2k/4k)")
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = ConceptMoEHarnessLM(run=str(run), device=device, batch_size=batch_size or 16, concept_ratio=ratio,
                             extrapolate=extrapolate)
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager,
                                  log_samples=False, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    return {"results": _clean(res["results"]), "groups": _clean(res.get("groups", {})),
            "n_samples": {t: v.get("effective", v.get("original")) for t, v in res.get("n-samples", {}).items()}}


def format_table(res: dict[str, Any]) -> str:
    """One line per task: its metrics (``acc``, ``acc_norm``, ``bits_per_byte``, ...)."""
    lines = []
    for task, row in sorted(res["results"].items()):
        n = res["n_samples"].get(task)
        vals = "  ".join(f"{k} {v:.4f}" for k, v in row.items() if v is not None and k != "sample_len")
        lines.append(f"{task:<20} {vals}" + (f"  (n={n})" if n is not None else ""))
    return "\n".join(lines)

"""Run directories and crash-safe checkpoints (supports the training pipeline of CONCEPTMOE.md §5).

A run directory holds::

    config.json          {"format", "version", "model": ModelConfig, "train": TrainConfig}
    tokenizer.json       the run's byte-level BPE
    metrics.jsonl        one JSON object per training step
    model.safetensors    weights of the latest checkpoint (hard link into checkpoints/)
    eval.json            final validation numbers (written when training completes)
    checkpoints/step-N/  model.safetensors, optimizer.safetensors + optimizer.json,
                         rng.safetensors, state.json (step, data position)

Atomicity: a checkpoint is written into ``checkpoints/.tmp-step-N`` and renamed to ``step-N``
only when complete (a directory rename is atomic), so a SIGKILL at any moment leaves either
the old or the new checkpoint whole. Older checkpoints are deleted only after the rename.
Nothing is ever unpickled: tensors are safetensors, everything else JSON.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from ..device import resolve_device  # noqa: F401  (part of this module's API)
from ..errors import UserError
from ..files import set_modes, write_json  # noqa: F401  (write_json: part of this module's API)
from ..model.config import ModelConfig
from ..model.lm import build_model
from ..data.tokenizer import load_tokenizer

RUN_FORMAT = "conceptmoe-run"
RUN_VERSION = 1
RUN_FILES = ("config.json", "tokenizer.json", "metrics.jsonl", "model.safetensors", "eval.json")
CKPT_DIR = "checkpoints"


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's config.json, or a UserError saying why ``run_dir`` is not a run."""
    path = Path(run_dir) / "config.json"
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir} is not a directory holding a run")
    if not path.is_file():
        raise UserError(f"{run_dir} holds no run (no config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is not valid JSON; the run is damaged") from None
    if not isinstance(cfg, dict) or cfg.get("format") != RUN_FORMAT or "model" not in cfg:
        raise UserError(f"{path} is not a conceptmoe run config")
    return cfg


def model_config_of(run_cfg: dict[str, Any]) -> ModelConfig:
    try:
        return ModelConfig.from_dict(run_cfg["model"])
    except (TypeError, ValueError) as e:
        raise UserError(f"run config holds an invalid model config: {e}") from None


def is_run(run_dir: str | Path) -> bool:
    return (Path(run_dir) / "config.json").is_file()


def never_trained(run_dir: str | Path) -> bool:
    """A run folder from a start that failed before anything was kept: a config but no checkpoint,
    no weights and no evaluation. It is not a run: the next ``train`` there starts over."""
    run_dir = Path(run_dir)
    return (is_run(run_dir) and latest_checkpoint(run_dir) is None
            and not any((run_dir / f).exists() for f in ("model.safetensors", "eval.json")))


def remove_run(run_dir: Path) -> None:
    """Delete a run's own files (``--force``); anything else in the folder is left alone."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / CKPT_DIR, ignore_errors=True)


# ----- checkpoints -----
def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CKPT_DIR / f"step-{step:08d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory (incomplete ones are never named step-N)."""
    root = Path(run_dir) / CKPT_DIR
    done = sorted(p for p in root.glob("step-*") if (p / "state.json").is_file()) if root.is_dir() else []
    return done[-1] if done else None


def save_checkpoint(run_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], optimizer_state: dict | None = None) -> Path:
    """Write a complete checkpoint for ``state["step"]`` atomically; drop older ones after.

    ``optimizer_state``: the optimizer's state dict when it is not ``optimizer.state_dict()``
    (gathered from sharded processes)."""
    run_dir = Path(run_dir)
    step = int(state["step"])
    root = run_dir / CKPT_DIR
    root.mkdir(exist_ok=True)
    tmp = root / f".tmp-step-{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"), metadata={"step": str(step)})
    tensors, meta = optimizer_to_safetensors(optimizer_state or optimizer.state_dict())
    save_file(tensors, tmp / "optimizer.safetensors")
    (tmp / "optimizer.json").write_text(json.dumps(meta))
    save_file(rng_state(), tmp / "rng.safetensors")
    set_modes(tmp)  # safetensors writes 0600 files; the others get the umask's mode
    (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))  # last: marks complete
    final = _step_dir(run_dir, step)
    if final.exists():  # re-saving a step (rare): move the old one aside, never leave a gap
        final.rename(root / f".old-step-{step:08d}")
    os.replace(tmp, final)
    link_latest_weights(run_dir, final)
    for old in root.iterdir():
        if old != final and (old.name.startswith((".tmp-", ".old-")) or old.name < final.name):
            shutil.rmtree(old, ignore_errors=True)
    return final


def link_latest_weights(run_dir: Path, ckpt: Path) -> None:
    """Point ``run_dir/model.safetensors`` at the checkpoint's weights (hard link, or copy)."""
    tmp = run_dir / ".model.safetensors.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(ckpt / "model.safetensors", tmp)
    except OSError:
        shutil.copyfile(ckpt / "model.safetensors", tmp)
    os.replace(tmp, run_dir / "model.safetensors")


def load_checkpoint(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device) -> dict[str, Any]:
    """Restore model, optimizer and RNG states in place; return state.json.

    Files that cannot be read are "damaged"; readable ones that do not fit this run (another
    model, another optimizer layout) say what differs and leave the checkpoint alone."""
    state, _, osd = read_checkpoint(ckpt)
    try:
        load_model(model, str(ckpt / "model.safetensors"), strict=True, device=str(device))
    except Exception as e:  # the bytes were read above: a key or shape mismatch
        raise UserError(f"checkpoint {ckpt} does not fit this run's model ({_first_line(e)}); "
                        f"the checkpoint itself is intact") from None
    load_optimizer_state(ckpt, optimizer, osd)
    return state


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _groups(groups: list[dict]) -> str:
    return ", ".join(f"{g.get('name', f'group {i}')} ({len(g['params'])} tensors)" for i, g in enumerate(groups))


def check_optimizer_fits(ckpt: Path, optimizer: torch.optim.Optimizer, osd: dict) -> None:
    """A UserError naming the difference when a checkpoint's optimizer groups are not this run's."""
    saved, have = osd["param_groups"], optimizer.param_groups
    same = len(saved) == len(have) and all(
        len(a["params"]) == len(b["params"]) and a.get("name", b.get("name")) == b.get("name", a.get("name"))
        for a, b in zip(saved, have))
    if not same:
        raise UserError(f"checkpoint {ckpt} does not fit this run's optimizer: its parameter groups are "
                        f"[{_groups(saved)}], this run's are [{_groups(have)}] (written by an older version "
                        f"under DDP?); the checkpoint itself is intact")


def load_optimizer_state(ckpt: Path, optimizer: torch.optim.Optimizer, osd: dict) -> None:
    check_optimizer_fits(ckpt, optimizer, osd)
    try:
        optimizer.load_state_dict(osd)
    except Exception as e:
        raise UserError(f"checkpoint {ckpt} does not fit this run's optimizer ({_first_line(e)}); "
                        f"the checkpoint itself is intact") from None


def read_checkpoint(ckpt: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict]:
    """(state.json, model tensors, optimizer state dict) of a checkpoint, on CPU; sets the RNG.
    Files that cannot be read or parsed are a UserError that calls the checkpoint damaged."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        weights = load_file(ckpt / "model.safetensors")
        opt = optimizer_from_safetensors(load_file(ckpt / "optimizer.safetensors"),
                                         json.loads((ckpt / "optimizer.json").read_text()))
        rng = load_file(ckpt / "rng.safetensors")
        int(state["step"])
    except Exception as e:  # any damage to the checkpoint files
        raise UserError(f"checkpoint {ckpt} is damaged ({type(e).__name__}: {_first_line(e)})") from None
    set_rng_state(rng)
    return state, weights, opt


def load_weights(model: torch.nn.Module, path: str | Path, device: torch.device | str = "cpu") -> None:
    """Load safetensors weights into ``model``; damaged or mismatching files are a UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} not found (has the run saved a checkpoint yet?)")
    try:
        load_model(model, str(path), strict=True, device=str(device))
    except Exception as e:  # SafetensorError (corrupt), RuntimeError (shape/key mismatch)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path} is corrupted or does not match the run's model config ({msg})") from None


# ----- optimizer and RNG state as safetensors + JSON -----
def optimizer_to_safetensors(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.detach().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_safetensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda.{i}"] = s
    return out


def set_rng_state(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"].cpu())
    cuda = [states[k].cpu() for k in sorted(k for k in states if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


# ----- metrics -----
def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """metrics.jsonl as a list; a torn last line (killed mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Keep only rows up to ``step`` (the checkpoint being resumed from)."""
    rows = [r for r in read_metrics(run_dir) if 0 < r.get("step", 0) <= step]
    tmp = run_dir / "metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, run_dir / "metrics.jsonl")


# ----- loading a trained run -----
def load_run_meta(run_dir: str | Path):
    """(ModelConfig, tokenizer, run config dict) of a trained run, without its weights."""
    run_dir = Path(run_dir)
    run_cfg = read_run_config(run_dir)
    cfg = model_config_of(run_cfg)
    tok = load_tokenizer(run_dir / "tokenizer.json")
    if tok.get_vocab_size() > cfg.vocab_size:
        raise UserError(f"{run_dir}/tokenizer.json has {tok.get_vocab_size()} entries but the model's "
                        f"vocabulary has {cfg.vocab_size}; the run is damaged")
    return cfg, tok, run_cfg


def load_run(run_dir: str | Path, device: str | torch.device | None = "auto"):
    """(model in eval mode, ModelConfig, tokenizer, run config dict) of a trained run."""
    run_dir = Path(run_dir)
    cfg, tok, run_cfg = load_run_meta(run_dir)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    model = build_model(cfg)
    load_weights(model, run_dir / "model.safetensors", "cpu")
    check_finite(model, run_dir / "model.safetensors")
    return model.to(dev).eval(), cfg, tok, run_cfg


def check_finite(model: torch.nn.Module, path: Path) -> None:
    """Refuse weights holding NaN or infinities (a diverged run): every output would be NaN."""
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise UserError(f"{path} holds {bad} NaN/infinite value(s) in {name}: the run's weights have diverged; "
                            "resume from an earlier checkpoint or train again")

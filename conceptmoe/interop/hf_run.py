"""``import_hf``: a Hugging Face MoE checkpoint directory -> a run directory of ours, and back.

Supports starting from pretrained MoEs (issue 10, part A; the MoE block of CONCEPTMOE.md §2b).
A HF directory holds ``config.json``, ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, and ``tokenizer.json``. The run directory written by
``import_hf`` is what ``conceptmoe train`` writes (``training/checkpoint.py``)::

    config.json        {"format", "version", "name", "model": ModelConfig, "train": {},
                        "source": where it came from: path, architecture, dtypes, file hashes,
                        the original config.json}
    model.safetensors  fp32 weights of our MoELM
    tokenizer.json     the source tokenizer, byte for byte

so ``load_run``, ``conceptmoe eval/generate/flops --config RUN`` work on it. ``export_hf`` writes
a MoE run as a HF directory (per-expert keys, fp32) that the matching transformers class loads.
Both build their folder in a temporary sibling and rename it into place (``files.building``): an
interrupted import or export leaves nothing that looks like a model. Nothing is downloaded,
nothing unpickled (``*.bin`` checkpoints are refused).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file, save_model

from ..errors import UserError
from ..files import building, check_out
from ..lock import held
from ..model.config import ModelConfig
from ..model.elastic import check_ratio
from ..model.lm import build_model
from ..training.checkpoint import RUN_FORMAT, RUN_VERSION, load_run, model_config_of, read_run_config, write_json
from ..data.tokenizer import load_tokenizer
from ..training.conventions import max_length, positions, token_ids
from .model_card import model_card
from .hf_config import ARCHS, arch_of, default_arch, hf_config_from_model, model_config_from_hf
from .hf_weights import from_hf, to_hf

INDEX = "model.safetensors.index.json"
HF_FILES = ("config.json", "model.safetensors", INDEX, "tokenizer.json", "generation_config.json")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise UserError(f"{path.parent} holds no {path.name}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is not valid JSON") from None


def weight_files(src: Path) -> tuple[list[str], dict[str, str] | None]:
    """Safetensors file names of a HF directory and the index's weight map (None: one file)."""
    if (src / INDEX).is_file():
        index = _read_json(src / INDEX)
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise UserError(f"{src / INDEX} has no weight_map")
        files = sorted(set(wmap.values()))
        bad = [f for f in files if not isinstance(f, str) or Path(f).name != f]
        if bad:
            raise UserError(f"{src / INDEX} names a shard outside the directory: {bad[0]!r}")
        return files, wmap
    if (src / "model.safetensors").is_file():
        return ["model.safetensors"], None
    if any(src.glob("*.safetensors")):
        raise UserError(f"{src} holds sharded *.safetensors but no {INDEX}")
    if any(src.glob("*.bin")) or any(src.glob("*.pt")):
        raise UserError(f"{src} holds only pickled weights (*.bin/*.pt), which are never loaded; "
                        "convert them to safetensors first")
    raise UserError(f"{src} holds no model.safetensors")


def read_tensors(src: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, and the files read."""
    files, wmap = weight_files(src)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if not (src / name).is_file():
            raise UserError(f"shard {name} listed in {INDEX} is missing")
        try:
            with safe_open(str(src / name), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    if key in tensors:
                        raise UserError(f"tensor {key!r} appears in more than one shard")
                    if wmap is not None and wmap.get(key) != name:
                        raise UserError(f"tensor {key!r} in {name} is not listed there in {INDEX}")
                    tensors[key] = fh.get_tensor(key)
        except UserError:
            raise
        except Exception as e:  # SafetensorError on a damaged file
            raise UserError(f"{src / name} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
    missing = sorted(set(wmap or {}) - set(tensors))
    if missing:
        raise UserError(f"{INDEX} lists {len(missing)} tensor(s) absent from the shards, e.g. {missing[0]!r}")
    return tensors, files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def replaceable(out: Path) -> bool:
    """Whether ``--force`` may replace ``out``: it holds a run or a checkpoint (a config.json)."""
    return (out / "config.json").is_file()


def _non_finite(obj: Any, where: str = "") -> str | None:
    """The first key holding NaN or an infinity in a parsed JSON value (None: all finite)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "the value"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{where}.{k}" if where else str(k))
        if found:
            return found
    return None


def _lookup(obj: Any, where: str) -> Any:
    for k in where.split("."):
        obj = obj[int(k)] if isinstance(obj, list) else obj[k]
    return obj


def _copy(src: Path, dst: Path) -> None:
    """Copy a file into a folder being built (``files.building`` makes the folder appear whole)."""
    shutil.copyfile(src, dst)


def save_weights(cfg: ModelConfig, state: dict[str, torch.Tensor], path: Path) -> None:
    """Write our state dict as the run's ``model.safetensors`` (tied embeddings stored once), into a
    folder being built by ``files.building`` (which makes the whole folder appear at once)."""
    with torch.device("meta"):  # no random init of a possibly large model
        model = build_model(cfg)
    model.load_state_dict({**state, "lm_head.weight": state.get("lm_head.weight", state["embed.weight"])},
                          strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    save_model(model, str(path))


def import_hf(src: str | Path, out: str | Path, force: bool = False) -> Path:
    """Convert a local OLMoE / Qwen2-MoE / Qwen3-MoE checkpoint into a run directory; returns it."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise UserError(f"{src} is not a directory holding a Hugging Face checkpoint")
    hf = _read_json(src / "config.json")
    if not isinstance(hf, dict):
        raise UserError(f"{src / 'config.json'} is not a JSON object")
    bad = _non_finite(hf)
    if bad:
        raise UserError(f"{src / 'config.json'}: {bad} is {_lookup(hf, bad)!r}; a config needs finite numbers")
    check_out(out, force, replaceable(out))
    gen = src / "generation_config.json"  # token ids that transformers' generate uses
    cfg = model_config_from_hf(hf, _read_json(gen) if gen.is_file() else None)
    tok = load_tokenizer(src / "tokenizer.json")
    if tok.get_vocab_size() > cfg.vocab_size:
        raise UserError(f"tokenizer.json has {tok.get_vocab_size()} tokens, more than vocab_size={cfg.vocab_size}")
    if src.resolve() == out.resolve():
        raise UserError("--out must differ from the source directory")
    tensors, files = read_tensors(src)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    state = from_hf(tensors, cfg)
    del tensors
    source = {"tool": "conceptmoe import-hf", "path": str(src.resolve()), "architecture": ARCHS[arch_of(hf)],
              "dtypes": dtypes, "sha256": {f: _sha256(src / f) for f in [*files, "config.json", "tokenizer.json"]},
              "hf_config": hf}
    with held(out), building(out, "import-hf", force, replaceable(out)) as tmp:
        save_weights(cfg, state, tmp / "model.safetensors")
        _copy(src / "tokenizer.json", tmp / "tokenizer.json")
        write_json(tmp / "config.json", {"format": RUN_FORMAT, "version": RUN_VERSION, "name": cfg.name,
                                         "model": cfg.to_dict(), "train": {}, "source": source})
    return out


def trained_length(run_cfg: dict) -> int:
    """The positions a run's export has by default: its training length (or an import's own)."""
    return max_length(run_cfg)


def export_hf(run: str | Path, out: str | Path, arch: str | None = None, force: bool = False,
              concept_ratio: float | None = None, extrapolate: bool = False, max_model_len: int | None = None) -> Path:
    """Write a MoE run as a HF checkpoint directory (``arch`` default: where it came from); returns it.

    ``concept_ratio``: an elastic ConceptMoE's default R in the exported config (None: its design ratio).
    ``max_model_len``: ``max_position_embeddings`` past the run's length (RoPE extrapolates; one
    warning says so)."""
    run, out = Path(run), Path(out)
    cfg = model_config_of(read_run_config(run))
    if cfg.image_size:
        raise UserError(f"{run} is a vision-language run; export-hf writes text-only models and would drop "
                        "its vision.* weights, so it is not exported")
    if run.resolve() == out.resolve():
        raise UserError("--out must differ from the run directory")
    if concept_ratio is not None:
        if not cfg.is_concept or cfg.elastic_ratios is None:
            raise UserError("--concept-ratio applies to elastic ConceptMoE runs only (trained with --ratios)")
        concept_ratio = float(concept_ratio)
        why = check_ratio(cfg, [concept_ratio], extrapolate, flag="--concept-ratio")
        if why:
            raise UserError(why)
    elif extrapolate:
        raise UserError("--extrapolate applies to a --concept-ratio outside the trained range")
    check_out(out, force, replaceable(out))
    if max_model_len is not None and max_model_len < 1:
        raise UserError(f"--max-model-len must be >= 1, got {max_model_len}")
    if cfg.is_concept and arch is None:  # a transformers "conceptmoe" directory (hf_export.py)
        from .hf_export import export_conceptmoe
        return export_conceptmoe(run, out, force, concept_ratio, extrapolate, max_model_len)
    from .hf_export import hf_tokenizer

    hf = hf_config_from_model(cfg, arch or default_arch(cfg))  # refuses ConceptMoE and mismatches
    model, cfg, tok, run_cfg = load_run(run, "cpu")
    ids = token_ids(run_cfg, tok)
    hf.update(ids, max_position_embeddings=positions(run_cfg, max_model_len))  # the source's, or ours
    tensors = to_hf({k: v.float() for k, v in model.state_dict().items()}, cfg, hf["model_type"])
    with held(out), building(out, "export-hf", force, replaceable(out)) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_tokenizer(run, tok, ids).save_pretrained(tmp)  # tokenizer_config.json: as the run
        _copy(run / "tokenizer.json", tmp / "tokenizer.json")  # the run's file itself, not a re-serialisation
        write_json(tmp / "config.json", hf)
        (tmp / "README.md").write_text(model_card(run, run_cfg, cfg), encoding="utf-8")
    return out

"""Evaluating a trained run (CONCEPTMOE.md §5): ``evaluate(run_dir, data=None)``.

A text run is measured on its own held-out split, or on all the text under ``data``
(memory-mapped token shards when the data was made by ``conceptmoe prepare``), with the metrics
the training loop logs (``training/validation.py``: loss, bits per byte, realised compression,
boundary-probability histogram). A vision-language run (``--data vlm-digits``) is measured on
its held-out images with the digits task's metrics (``training/digits.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


from ..errors import UserError
from ..model.elastic import require_ratio
from ..model.health import compression_off
from ..data.digits import VLM_DATA, eval_examples, load_digits
from ..training.checkpoint import load_run, read_run_config
from ..training.digits import N_EVAL, evaluate_vlm
from ..data.corpus import DOC_SEP, check_record, load_corpus, read_documents
from ..data.shards import is_prepared, open_prepared
from ..data.tokenizer import byte_lengths, encode_documents, sha256
from ..training.validation import EVAL_BATCH, evaluate_tokens

def evaluate(run_dir: str | Path, data: str | Path | None = None, device: str = "auto",
             batch_size: int | None = None, max_tokens: int | None = None,
             progress: bool = False, ratio: float | None = None, extrapolate: bool = False) -> dict[str, Any]:
    """Evaluate a trained run: on its held-out split, or on all the text under ``data``
    (a directory made by ``conceptmoe prepare``: its held-out split). ``ratio``: the R asked of
    an elastic ConceptMoE (outside the trained range only with ``extrapolate``).

    The held-out split is rebuilt from the run's stored (absolute) data path and checked
    against the stored fingerprint; ``max_tokens`` defaults to the run's ``val_tokens``.
    """
    model, cfg, tok, run_cfg = load_run(run_dir, device)
    ratio = require_ratio(cfg, ratio, extrapolate)
    ids, max_tokens = held_out_tokens(run_cfg, cfg, tok, data, max_tokens)
    seq_len = int(run_cfg.get("train", {}).get("seq_len", 256))
    return evaluate_tokens(model, ids, byte_lengths(tok, cfg.vocab_size), seq_len,
                           batch_size or EVAL_BATCH, max_tokens, progress, ratio, extrapolate, health=True)


def held_out_tokens(run_cfg: dict[str, Any], cfg, tok, data: str | Path | None = None,
                    max_tokens: int | None = None):
    """(token ids of the run's held-out split, or of all text under ``data``; the token cap,
    defaulting to the run's ``val_tokens`` for the held-out split)."""
    train_cfg = run_cfg.get("train", {})
    source = train_cfg.get("data") if data is None else data
    prep = open_prepared(source) if is_prepared(source) else None  # `conceptmoe prepare` shards
    if prep is not None and sha256(tok) != prep.manifest["tokenizer"]["sha256"]:
        raise UserError(f"{source} was prepared with another tokenizer than the run's")
    if data is None:
        record = run_cfg.get("data")
        corpus = prep or load_corpus(train_cfg.get("data"), legacy_split=record is None)
        check_record(record, corpus.record())
        texts = None if prep else [d.text for d in corpus.val]
        if max_tokens is None:
            max_tokens = train_cfg.get("val_tokens")
    else:
        texts = None if prep else [d.text for d in read_documents(data)]
    ids = prep.val_tokens if prep else encode_documents(tok, texts, DOC_SEP)
    if prep is None and int(ids.max(initial=0)) >= cfg.vocab_size:
        raise UserError("tokenizer.json does not fit the model's vocabulary; the run is damaged")
    return ids, max_tokens


def is_vlm_run(run_dir: str | Path) -> bool:
    """The run was trained on the digits task (False for anything unreadable: the text path
    reports that)."""
    try:
        return read_run_config(run_dir).get("train", {}).get("data") == VLM_DATA
    except UserError:
        return False


def evaluate_vlm_run(run_dir: str | Path, device: str = "auto") -> dict[str, float]:
    """``evaluate_vlm`` of a trained vlm-digits run on the fixed held-out examples."""
    model, cfg, _, _ = load_run(run_dir, device)
    digits = load_digits()
    return evaluate_vlm(model, digits, eval_examples(digits, N_EVAL, cfg.n_patches))


def compression_warning(realised: float, target: float, router: str = "cosine") -> str | None:
    """A one-line warning when a learned router's held-out compression is far from its target R.

    The ratio loss holds the *training-time* compression (Bernoulli samples of p: about 1/mean p) at
    R; evaluation and inference cut where p >= 0.5. The two agree only when p is decisive: measured
    on the `small` preset at 1.2M tokens with sharpness 1, R = 4 realised 22-46 (docs/study-elastic)."""
    off = None if router == "fixed" else compression_off(realised, target)  # the band of model/health.py
    if off is None:
        return None
    return (f"warning: held-out compression {realised:.2f} is {off:+.0%} off the target R = {target:g}: the router's "
            f"boundary probabilities are not decisive (training samples Bernoulli(p), evaluation cuts at p >= 0.5); "
            f"see docs/study-elastic/README.md")

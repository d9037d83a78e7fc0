"""What a run's tokens and length mean outside training: BOS / EOS / PAD ids and the maximum length.

Issue 19 (generation, CONCEPTMOE.md §4; evaluation, §5). ``export-hf``, ``conceptmoe generate``
and the lm-evaluation-harness model read them here, so that all three agree:

- ``token_ids``: an imported checkpoint's own ``bos/eos/pad_token_id`` (``import-hf`` keeps them
  in ``ModelConfig.extra["token_ids"]``, ``convert`` carries ``extra`` on; older imports have them
  in ``source.hf_config``), else the tokenizer's ``<|endoftext|>`` as EOS and ``<|pad|>`` as PAD
  (``data/tokenizer.py``). Runs whose tokenizer predates special tokens have neither.
- ``prefix_id``: the token before a document, the harness's ``hf`` rule: BOS, else EOS; runs with
  neither get the last token of ``DOC_SEP``, what separated their training documents.
- ``max_length``: the model's maximum length, which the harness's ``hf`` model reads from
  ``max_position_embeddings``: an imported checkpoint's, else the training length, else 2048
  (the harness's default).
"""

from __future__ import annotations

import sys

from typing import Any

from ..data.corpus import DOC_SEP
from ..data.tokenizer import EOT, PAD

DEFAULT_MAX_LENGTH = 2048  # lm-evaluation-harness's when a config names no length
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def token_ids(run_cfg: dict[str, Any], tok) -> dict[str, Any]:
    """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` of a run (an id, a list of ids for EOS, or None)."""
    model = run_cfg.get("model") or {}
    stored = (model.get("extra") or {}).get("token_ids")
    if stored is None:
        stored = (run_cfg.get("source") or {}).get("hf_config")
    if stored is not None:
        return {k: stored.get(k) for k in TOKEN_FIELDS}
    return {"bos_token_id": None, "eos_token_id": tok.token_to_id(EOT), "pad_token_id": tok.token_to_id(PAD)}


def eos_list(ids: dict[str, Any]) -> list[int]:
    """The EOS ids as a list (a checkpoint may name several)."""
    eos = ids.get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def prefix_id(ids: dict[str, Any], tok) -> int:
    """BOS, else the first EOS, else the last token of ``DOC_SEP`` (see the module docstring)."""
    if ids.get("bos_token_id") is not None:
        return int(ids["bos_token_id"])
    eos = eos_list(ids)
    return eos[0] if eos else tok.encode(DOC_SEP).ids[-1]


def max_length(run_cfg: dict[str, Any]) -> int:
    """The model's maximum length (see the module docstring)."""
    extra = (run_cfg.get("model") or {}).get("extra") or {}
    if extra.get("max_position_embeddings"):
        return int(extra["max_position_embeddings"])
    seq_len = (run_cfg.get("train") or {}).get("seq_len")
    return int(seq_len) if seq_len else DEFAULT_MAX_LENGTH


def positions(run_cfg: dict, max_model_len: int | None) -> int:
    """The exported ``max_position_embeddings``: the run's length, or ``max_model_len`` past it, with
    one warning that positions past training are extrapolated (RoPE has no table to run off)."""
    trained = max_length(run_cfg)
    if max_model_len is None or max_model_len <= trained:
        return trained
    print(f"warning: max_position_embeddings {max_model_len} is past the {trained} tokens this run was trained on; "
          f"RoPE extrapolates positions past {trained} (quality there is untested)", file=sys.stderr, flush=True)
    return max_model_len

"""``export_conceptmoe``: a ConceptMoE run -> a self-contained transformers model directory (issue 11 A).

The directory holds::

    config.json                 ConceptMoEConfig (model_type "conceptmoe", auto_map, our ModelConfig)
    model.safetensors           the weights (fp32, keys ``model.<our state-dict key>``)
    generation_config.json      bos/eos/pad ids (``training/conventions.py``: the run's tokenizer's
                                ``<|endoftext|>`` / ``<|pad|>``, or an imported source's own ids)
    tokenizer.json              the run's tokenizer (plus ``<|pad|>`` if it has no pad token)
    tokenizer_config.json       (written by transformers' tokenizer ``save_pretrained``)
    configuration_conceptmoe.py / modeling_conceptmoe.py   remote code for ``trust_remote_code=True``

The remote-code files are two-line subclasses of ``conceptmoe.interop.hf_model``: the model code
is the package's own, so **the ``conceptmoe`` package must be installed where the directory is
loaded** (transformers can only import installed packages or files of the same folder; copying
the whole method into the folder would fork it). With ``conceptmoe`` imported, ``AutoConfig`` /
``AutoModelForCausalLM`` load the directory without ``trust_remote_code`` too (``hf_register.py``).

``pad_token_id`` (config and generation config) is always an id of the model's vocabulary, since
``generate`` feeds it to finished rows. A run whose tokenizer has no pad token (made before
special tokens) gets ``<|pad|>`` added to the tokenizer after its last entry, which may lie
outside the vocabulary: padding never reaches the embedding when ``attention_mask`` is given,
without a mask such ids are taken to be padding (``hf_model.py``), and the config's
``pad_token_id`` is then the EOS or prefix token. ``max_position_embeddings`` is the run's
maximum length, which lm-evaluation-harness's ``hf`` model reads.
Needs the optional ``transformers`` dependency (``pip install -e ".[hf]"``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..files import building
from ..lock import held
from ..training.checkpoint import load_run
from ..training.conventions import eos_list, positions, prefix_id, token_ids
from .hf_remote_code import AUTO_MAP, REMOTE_FILES
from .model_card import model_card

PAD = "<|pad|>"
HF_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "README.md", *REMOTE_FILES)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("exporting a ConceptMoE run needs transformers: pip install -e \".[hf]\"") from None
    return transformers


def hf_tokenizer(run: Path, tok, ids: dict, pad: str | None = None):
    """The run's tokenizer as transformers' ``PreTrainedTokenizerFast``, its special tokens named
    (bos, eos, pad: the run's own ids), ``pad`` added when the run has no pad token. Saved beside an
    export, its ``tokenizer_config.json`` names this class: ``AutoTokenizer`` (vLLM, lm-eval's
    ``hf``) then tokenizes with the run's own pre-tokenizer and normaliser, not those of the tokenizer
    class of the config's ``model_type`` (issue 68: Qwen2's regex and NFC split the run's text otherwise)."""
    eos = eos_list(ids)
    named = {"bos_token": ids["bos_token_id"], "eos_token": eos[0] if eos else None, "pad_token": ids["pad_token_id"]}
    names = {k: tok.id_to_token(i) for k, i in named.items() if i is not None and tok.id_to_token(i) is not None}
    return _transformers().PreTrainedTokenizerFast(tokenizer_file=str(run / "tokenizer.json"),
                                                   **{**({"pad_token": pad} if pad else {}), **names})


def export_conceptmoe(run: str | Path, out: str | Path, force: bool = False,
                      concept_ratio: float | None = None, extrapolate: bool = False,
                      max_model_len: int | None = None) -> Path:
    """Write the run as a transformers model directory (see the module docstring); returns it."""
    from .hf_model import ConceptMoEConfig, ConceptMoEForCausalLM

    tr = _transformers()
    run, out = Path(run), Path(out)
    if run.resolve() == out.resolve():
        raise UserError("--out must differ from the run directory")
    model, cfg, tok, run_cfg = load_run(run, "cpu")
    model = model.float().eval()
    ids = token_ids(run_cfg, tok)
    eos = eos_list(ids)
    hf_tok = hf_tokenizer(run, tok, ids, PAD)
    pad = hf_tok.pad_token_id
    if pad >= cfg.vocab_size:  # generate feeds pad_token_id to finished rows: it must be a token of the model
        pad = eos[0] if eos else prefix_id(ids, tok)
    config = ConceptMoEConfig(conceptmoe=cfg.to_dict(), pad_token_id=pad, bos_token_id=ids["bos_token_id"],
                              eos_token_id=ids["eos_token_id"], prefix_token_id=prefix_id(ids, tok),
                              max_position_embeddings=positions(run_cfg, max_model_len), architectures=["ConceptMoEForCausalLM"],
                              concept_ratio=concept_ratio, extrapolate=extrapolate)
    config.auto_map = dict(AUTO_MAP)
    with torch.device("meta"):  # no random init: the run's own module goes in
        hf = ConceptMoEForCausalLM(config)
    hf.model = model
    hf.generation_config = tr.GenerationConfig(pad_token_id=pad, bos_token_id=ids["bos_token_id"],
                                               eos_token_id=ids["eos_token_id"])
    # Built in a temporary sibling, renamed into place whole; --force replaces, never merges.
    with held(out), building(out, "export-hf", force, (out / "config.json").is_file()) as tmp:
        hf.save_pretrained(tmp)  # config, weights, generation config and the remote-code files
        hf_tok.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(run, run_cfg, cfg, concept_ratio), encoding="utf-8")
    return out

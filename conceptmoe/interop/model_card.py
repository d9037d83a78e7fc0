"""The model card ``export-hf`` writes beside the weights (``README.md``, Hugging Face's format).

A YAML metadata header (license, library, tags, pipeline) and the sections a user of an exported
model needs: the architecture and its compression ratio R, the compute match against the MoE of
the same preset (activated FLOPs per token and total parameters, ``model/flops.py``), the
training data and tokens, the held-out bits per byte and realised compression that ``train`` /
``eval`` recorded (``eval.json``), how to load it, and its limitations. Every figure is read
from the run directory; a figure the run does not hold is said to be missing, never invented.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..model.config import PRESETS, ModelConfig
from ..model.flops import count_flops

PAPER = "https://arxiv.org/abs/2601.21420"


def _eval_record(run: Path) -> dict:
    try:
        return json.loads((run / "eval.json").read_text())
    except (OSError, ValueError):
        return {}


def _baseline(cfg: ModelConfig) -> ModelConfig | None:
    preset = (cfg.extra or {}).get("preset")
    if not cfg.is_concept or preset not in PRESETS:
        return None
    base = ModelConfig.from_preset(preset, kind="moe")
    return base if (base.d_model, base.vocab_size) == (cfg.d_model, cfg.vocab_size) else None


def _compute_lines(cfg: ModelConfig, seq_len: int) -> list[str]:
    me = count_flops(cfg, seq_len)
    lines = [f"- Activated FLOPs per token: {me['activated_flops_per_token'] / 1e6:.2f} M "
             f"(at {seq_len} tokens, R = {me['compression']:g}); total parameters {me['total_params'] / 1e6:.2f} M."]
    base = _baseline(cfg)
    if base is not None:
        b = count_flops(base, seq_len)
        df = me["activated_flops_per_token"] / b["activated_flops_per_token"] - 1
        dp = me["total_params"] / b["total_params"] - 1
        lines.append(f"- Compute match against `{base.name}` (the `{cfg.extra['preset']}` MoE): activated FLOPs "
                     f"{100 * df:+.2f}%, total parameters {100 * dp:+.2f}% "
                     f"(attention-map FLOPs excluded, as in the paper).")
    elif cfg.is_concept:
        lines.append("- No compute-matched MoE is recorded for this run (not built from a preset).")
    return lines


def model_card(run: Path, run_cfg: dict, cfg: ModelConfig, concept_ratio: float | None = None) -> str:
    ev = _eval_record(run)
    train = run_cfg.get("train") or {}
    data = run_cfg.get("data") or {}
    seq_len = int(train.get("seq_len") or 2048)
    kind = "ConceptMoE" if cfg.is_concept else "MoE"
    tags = ["conceptmoe" if cfg.is_concept else "moe", "mixture-of-experts", "text-generation"]
    head = ["---", "license: apache-2.0", "library_name: transformers", "pipeline_tag: text-generation", "tags:",
            *[f"- {t}" for t in tags], "---", "", f"# {run_cfg.get('name') or cfg.name}", ""]
    arch = [f"A {kind} language model trained with the `conceptmoe` library "
            f"(ConceptMoE: [arXiv 2601.21420]({PAPER})).", "", "## Architecture", ""]
    if cfg.is_concept:
        arch += [f"- {cfg.n_encoder_layers} token-level encoder layers, {cfg.n_concept_layers} concept layers"
                 + (f" looped {cfg.concept_loops}x" if cfg.concept_loops > 1 else "")
                 + f", {cfg.n_decoder_layers} token-level decoder layers; d_model {cfg.d_model}, "
                 f"{cfg.n_heads} heads ({cfg.n_kv_heads} key/value).",
                 f"- Experts: {cfg.n_experts} (top-{cfg.top_k}) at token level, {cfg.concept_experts} "
                 f"(top-{cfg.concept_k}) in the concept layers.",
                 f"- Chunk router: {cfg.chunk_router}; target compression R = {cfg.compression_ratio:g} tokens per "
                 "concept; the concept layers' KV cache holds one entry per concept, about R times fewer."]
        if cfg.elastic_ratios:
            arch.append(f"- Elastic: trained for R in {cfg.elastic_ratios}; choose R per call with "
                        f"`concept_ratio=` (exported default: {concept_ratio or cfg.compression_ratio:g}).")
    else:
        arch.append(f"- {cfg.n_layers} MoE layers, {cfg.n_experts} experts (top-{cfg.top_k}), d_model {cfg.d_model}.")
    arch += _compute_lines(cfg, seq_len)
    tokens = (int(train["max_steps"]) * int(train.get("batch_size", 0)) * int(train.get("grad_accum", 1)) * seq_len
              if train.get("max_steps") and train.get("batch_size") else None)
    trained = ["", "## Training", "",
               f"- Data: `{data.get('source') or train.get('data') or 'not recorded'}`"
               + (f" ({data['train_tokens']:,} training tokens, held-out split: {data.get('split', 'not recorded')})"
                  if data.get("train_tokens") else ""),
               f"- Trained for {tokens:,} tokens ({train['max_steps']} steps of {train['batch_size']} x {seq_len})"
               if tokens else "- Training budget: not recorded (an imported or converted run)",
               f"- Precision: {run_cfg.get('precision', 'not recorded')}; learning rate {train.get('lr', 'not recorded')}."]
    if ev:
        res = [f"- Held-out bits per byte: {ev['val_bpb']:.4f} (loss {ev['val_loss']:.4f} nats/token over "
               f"{ev.get('tokens', 0):,} tokens) at step {ev.get('step', '?')}."]
        if cfg.is_concept and ev.get("compression") is not None:
            res.append(f"- Realised compression on held-out text: {ev['compression']:.2f} tokens per concept "
                       f"(target {cfg.compression_ratio:g}).")
    else:
        res = ["- No held-out evaluation is recorded in the run (run `conceptmoe eval RUN` before exporting)."]
    load = ["", "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
            'tok = AutoTokenizer.from_pretrained("PATH")',
            'model = AutoModelForCausalLM.from_pretrained("PATH"' + (", trust_remote_code=True" if cfg.is_concept else "")
            + ")", 'ids = tok("To be, or not to be", return_tensors="pt").input_ids',
            "print(tok.decode(model.generate(ids, max_new_tokens=40)[0]))", "```", ""]
    if cfg.is_concept:
        load += ["The ConceptMoE architecture is not part of transformers: its code ships in this directory and "
                 "loads with `trust_remote_code=True` (read it first, as with any remote code).", ""]
    limits = ["## Limitations", "",
              "- A research model at small scale: trained on the data above only, it has no instruction tuning, "
              "no safety tuning and no knowledge beyond that text.",
              f"- Trained at {seq_len} tokens per sequence; longer inputs run (RoPE) but were never trained on."]
    if cfg.is_concept:
        limits.append("- Concept boundaries depend on the text: the realised compression on other text can differ "
                      "from the target R, and with it the speed and the KV-cache size.")
    return "\n".join(head + arch + trained + ["", "## Results", ""] + res + load + limits) + "\n"

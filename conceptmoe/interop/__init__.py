"""Checkpoints from elsewhere: Hugging Face OLMoE / Qwen2-MoE / Qwen3-MoE <-> our MoE runs.

Supports starting from pretrained MoEs (issue 10; the MoE block of CONCEPTMOE.md §2b):

- ``hf_config.py``: HF ``config.json`` <-> ``ModelConfig``; refuses what ours cannot represent;
- ``hf_weights.py``: HF tensors <-> our state dict, key by key (per-expert and fused experts);
- ``hf_run.py``: ``import_hf`` (HF directory -> run directory) and ``export_hf`` (MoE run ->
  HF directory);
- ``convert.py``: ``convert_run`` (MoE run -> ConceptMoE run with an exact start, part B).

May import ``model/``, ``inference/`` and ``training/`` (run directories, tokenizer), never
``cli/`` or ``bench/``. ``transformers`` itself is not needed: configs are plain JSON and
weights safetensors (the tests use transformers to check exactness).
"""

from .convert import convert_run
from .hf_run import export_hf, import_hf

__all__ = ["convert_run", "export_hf", "import_hf"]

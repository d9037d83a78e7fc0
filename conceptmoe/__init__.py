"""ConceptMoE: adaptive token-to-concept compression for mixture-of-experts LMs (arXiv 2601.21420).

Layout (dependencies run one way, docs/architecture.md shows the tree):
``model/`` the method (§2-3), ``inference/`` cached decoding (§4), ``data/`` corpora, tokenizer
and shards, ``parallel/`` DDP / FSDP2 / expert parallelism applied from outside, ``training/`` the
loop and the run directory, ``evaluation/`` evaluate / compare / boundaries, ``interop/``
transformers and checkpoints from elsewhere, ``harness/`` lm-evaluation-harness, ``bench/``
benchmarks, ``cli/`` the command line; ``errors``, ``files``, ``device`` and ``lock`` are shared.
"""

from . import inference  # noqa: F401  (gives the models their ``generate`` method)
from .model import ConceptMoELM, ModelConfig, ModelOutput, MoELM, build_model, count_flops, match_config
from .training.checkpoint import load_run
from .interop.hf_register import install as _install_hf  # noqa: E402

_install_hf()  # AutoConfig / AutoModelForCausalLM learn "conceptmoe" once transformers is imported

__all__ = ["ModelConfig", "build_model", "ModelOutput", "MoELM", "ConceptMoELM", "load_run",
           "count_flops", "match_config"]
__version__ = "0.1.0"

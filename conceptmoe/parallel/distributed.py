"""Multi-process training on PyTorch's own engine: torchrun, DDP or FSDP2, one code path.

``torchrun --standalone --nproc_per_node N -m conceptmoe train ...`` starts N processes; each
reads ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` (``setup``) and joins one process group: NCCL on
CUDA (one GPU per local rank), gloo on CPU, with a collective timeout so that a dead rank ends
the job instead of hanging it. The device mesh is passed explicitly
(``init_device_mesh(device_type, (N,))``): the default one follows the accelerator and breaks
gloo on a GPU host (pytorch#132471). One process (no ``WORLD_SIZE``) is the same code path with
``Dist.world == 1``. A worker whose torchrun agent dies (``kill -9``) stops itself with SIGTERM
(``watch_parent``): every worker checkpoints, releases the run lock and exits within seconds.

``parallelize(model, dist, mode, dtype)`` is applied to a plain model from outside (the model
never asks for a rank): it sets ``model.stats_reduce`` to a sum over ranks, so the ratio loss,
balance loss, z-loss and compression are global (``model/stats.py``), then wraps the model in
``DistributedDataParallel`` or shards it with FSDP2 (``fully_shard`` per block, then the root;
fp32 parameters: ``--dtype bf16`` is the training loop's autocast in every mode), or shards
the experts over groups of processes (``expert_parallel.py``, with DDP-style averaging).

Checkpoints of a parallelized model are written and read by ``training/parallel_checkpoint.py``
(the single-process format, whatever the mode), with ``unwrap``, ``is_sharded`` and ``param_names``
from here.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UserError
from ..device import resolve_device
from . import expert_parallel as ep

TIMEOUT_S = int(os.environ.get("CONCEPTMOE_DIST_TIMEOUT", "300"))  # a collective waits this long at most
PARENT_POLL_S = 1.0  # how often a worker checks that its torchrun agent is alive
PARALLEL_MODES = ("ddp", "fsdp")


@dataclass
class Dist:
    """This process's place in the job (world 1: a plain single-process run)."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: Any = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a (detached) tensor over all ranks."""
        if self.world == 1:
            return t
        out = t.detach().clone()
        dist.all_reduce(out)
        return out

    def mean(self, value: float) -> float:
        if self.world == 1:
            return value
        return float(self.sum(torch.tensor([value], dtype=torch.float64, device=self.device))) / self.world

    def any(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        return bool(self.sum(torch.tensor([float(flag)], device=self.device)) > 0)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def run_on_main(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0; its result (or its UserError) is shared with every rank."""
        if self.world == 1:
            return fn()
        box: list[Any] = [None]
        if self.main:
            try:
                box[0] = ("ok", fn())
            except UserError as e:
                box[0] = ("error", str(e))
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise UserError(value)
        return value


def setup(device: str = "auto") -> Dist:
    """Join the torchrun job described by the environment (or stay a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(device=resolve_device(device))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    if device == "cuda" and not use_cuda:
        raise UserError("--device cuda requested but CUDA is not available")
    if use_cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=TIMEOUT_S))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world,))
    watch_parent()
    return Dist(world, rank, local, dev, mesh)


def watch_parent(interval: float = PARENT_POLL_S, on_orphan=None) -> None:
    """SIGTERM this worker when its parent (the torchrun agent, compare's process) dies: the run
    then stops like a scheduler's SIGTERM stops it (checkpoint, lock released) instead of training
    on, orphaned. A thread polls ``os.getppid()``: an orphan is re-parented (to init or a
    subreaper). ``on_orphan`` replaces the SIGTERM (``training/jobs.py``: and then exit)."""
    parent = os.getppid()

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        if on_orphan is None:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            on_orphan()

    threading.Thread(target=poll, name="conceptmoe-parent-watch", daemon=True).start()


def teardown(d: Dist) -> None:
    if d.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of either model (the units FSDP shards one by one)."""
    out = []
    for name in ("layers", "encoder", "concept", "decoder"):
        out += list(getattr(model, name, []))
    return out


def check_layout(world: int, mode: str, experts: int, expert_counts: list[int]) -> None:
    """Refuse a parallel layout that cannot run, before anything is written: the mode, and
    ``--expert-parallel S`` (torchrun only, with DDP, S dividing the processes and every MoE
    layer's expert count ``expert_counts``)."""
    if mode not in PARALLEL_MODES:
        raise UserError(f"--parallel must be one of {', '.join(PARALLEL_MODES)} (got {mode!r})")
    if experts == 1:
        return
    if experts > 1 and mode == "fsdp":
        raise UserError("--expert-parallel combines with --parallel ddp, not fsdp")
    if world == 1:
        raise UserError(f"--expert-parallel {experts} shards experts over processes: start the run with "
                        f"torchrun --nproc_per_node N (N a multiple of {experts}), or leave it out")
    if world % experts:
        raise UserError(f"--expert-parallel {experts} must divide the number of processes ({world})")
    bad = sorted({n for n in expert_counts if n % experts})
    if bad:
        raise UserError(f"--expert-parallel {experts} must divide the number of experts of every MoE layer "
                        f"({', '.join(map(str, bad))})")


def parallelize(model: nn.Module, d: Dist, mode: str, dtype: str, experts: int = 1) -> nn.Module:
    """The module to train: the model itself (1 process, FSDP-sharded in place, or with its
    experts sharded over ``experts`` processes) or a DDP wrapper."""
    check_layout(d.world, mode, experts, [m.n_experts for m in ep.moe_layers(model)])
    if d.world == 1:
        return model  # one process: nothing to distribute (--parallel, --expert-parallel: torchrun only)
    model.stats_reduce = d.sum
    if experts > 1:  # experts sharded; gradients synchronised by expert_parallel.sync_grads
        ep.shard(model, ep.setup(d.world, d.rank, experts))
        return model
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        # fp32 parameters and reductions whatever --dtype: bf16 is the loop's autocast, as under DDP
        # (param_dtype=bf16 would also make norms, the residual stream and the islands' inputs bf16).
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for blk in blocks(model):
            fully_shard(blk, mesh=d.mesh, mp_policy=mp)
        fully_shard(model, mesh=d.mesh, mp_policy=mp)
        register_fsdp_forward_method(model, "collect_stats")  # called outside forward (gradient accumulation)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # Experts that receive no token in a step get no gradient on the split path.
    return DistributedDataParallel(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None,
                                   find_unused_parameters=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 shards in place: the module is the model)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def param_names(opt: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """Parameter names in the optimizer's own order (its state_dict's integer ids)."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)

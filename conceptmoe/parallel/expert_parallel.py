"""Expert parallelism: each MoE layer's experts sharded over the processes of an EP group.

``--expert-parallel S`` splits the world into groups of S consecutive ranks; rank r of a group
holds experts [r·E/S, (r+1)·E/S) of every MoE layer (token-rate and concept layers alike) and
the processes with the same position in their groups hold replicas of the same experts. A
layer's forward (the pattern of torchtitan and Megatron-LM):

1. route locally; sort the (token, expert) pairs by expert (``MoE._experts_sorted``);
2. exchange the per-expert counts (all-gather), then the rows themselves with a variable-size
   ``all_to_all_single`` (autograd-aware: its backward is the reverse exchange);
3. regroup the received rows by local expert and run the grouped matmul on the local weights;
4. the reverse all-to-all brings every output home, in the order it left.

Gradients: the model's loss on each process is a local mean and the global loss their average,
so replicated (non-expert) parameters are all-reduced and averaged over the world, and an
expert's gradient, which already sums the contributions of its whole EP group, is summed over
its replicas and divided by the world size (``sync_grads``). The gradient norm is global (the
expert squares summed over the EP group, replicated parameters once) and every rank clips by
the same factor (``clip_grad_norm``), so the replicas stay bit-identical. Checkpoints gather the full
experts (and their optimizer state) onto rank 0 in the single-process format.

Shape legend: M rows (token, expert slots), D d_model, E experts, L = E / S local experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from ..errors import UserError
from ..model.moe import MoE

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


@dataclass
class EPGroup:
    size: int  # S processes share one layer's experts
    rank: int  # position in the group
    group: object  # the EP process group
    replicas: object  # processes holding the same experts (one per EP group)


def setup(world: int, rank: int, size: int) -> EPGroup:
    """Create the EP and replica groups (every process must call this, in the same order)."""
    if size < 1 or world % size:
        raise UserError(f"--expert-parallel {size} must divide the number of processes ({world})")
    ep = rep = None
    for start in range(0, world, size):  # new_group is collective: every rank creates every group
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            ep = g
    for pos in range(size):
        g = dist.new_group(list(range(pos, world, size)))
        if rank % size == pos:
            rep = g
    return EPGroup(size, rank % size, ep, rep)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _local(n_experts: int, ep: EPGroup) -> slice:
    n = n_experts // ep.size
    return slice(ep.rank * n, (ep.rank + 1) * n)


def shard(model: nn.Module, ep: EPGroup) -> None:
    """Keep this process's experts only and route the others over the EP group."""
    for moe in moe_layers(model):
        if moe.n_experts % ep.size:
            raise UserError(f"--expert-parallel {ep.size} must divide the number of experts ({moe.n_experts})")
        keep = _local(moe.n_experts, ep)
        for name in EXPERT_WEIGHTS:
            setattr(moe, name, nn.Parameter(getattr(moe, name).detach()[keep].clone()))
        moe.expert_dispatch = lambda m, xs, counts, grouped, scale, ep=ep: dispatch(m, xs, counts, grouped, ep, scale)
    model.expert_parallel = ep


def dispatch(moe: MoE, xs: torch.Tensor, counts: torch.Tensor, grouped: bool, ep: EPGroup,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """Expert outputs for rows xs (M, D) sorted by global expert, computed where the experts live
    (in xs's dtype: bf16 rows under autocast). ``scale`` (M, 1): routing weights, which travel with
    the rows and scale the hidden activations (``MoE.expert_ffn``)."""
    S, E, D = ep.size, moe.n_experts, xs.shape[1]
    L = E // S
    every = [torch.zeros_like(counts) for _ in range(S)]
    dist.all_gather(every, counts, group=ep.group)
    recv = torch.stack(every)[:, ep.rank * L:(ep.rank + 1) * L]  # (S, L): rows from source s for local e
    send_sizes = counts.view(S, L).sum(1).tolist()
    recv_sizes = recv.sum(1).tolist()
    xr = all_to_all_single(xs.new_empty(sum(recv_sizes), D), xs, recv_sizes, send_sizes, group=ep.group)
    # received: source-major (s, e) blocks; the grouped matmul wants expert-major (e, s)
    flat = recv.flatten()
    start = flat.cumsum(0) - flat
    perm = torch.cat([torch.arange(int(start[s * L + e]), int(start[s * L + e] + flat[s * L + e]), device=xs.device)
                      for e in range(L) for s in range(S)]) if xr.shape[0] else torch.zeros(0, dtype=torch.long,
                                                                                                device=xs.device)
    sr = None if scale is None else \
        all_to_all_single(scale.new_empty(sum(recv_sizes), 1), scale, recv_sizes, send_sizes, group=ep.group)[perm]
    out = moe.expert_ffn(xr[perm], recv.sum(0), grouped, scale=sr)
    back = out[torch.argsort(perm)]  # source-major again
    return all_to_all_single(xs.new_empty(sum(send_sizes), D), back, send_sizes, recv_sizes, group=ep.group)


def is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS and ".moe." in f".{name}"


def sync_grads(model: nn.Module, world: int) -> None:
    """Average gradients like data parallelism does, experts over their replicas (see module doc)."""
    ep: EPGroup = model.expert_parallel
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=ep.replicas if is_expert(name) else None)
        p.grad.div_(world)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm of an expert-sharded model (call after ``sync_grads``), every
    gradient scaled by the one clip factor ``min(1, max_norm / (norm + 1e-6))`` that
    ``torch.nn.utils.clip_grad_norm_`` would apply to the unsharded model.

    Replicated gradients are equal on every rank after ``sync_grads`` and count once; each rank's
    expert squares are summed over its EP group (which holds every expert once). The norm, and so
    the clip factor and the non-finite check, is the same number on every rank.
    """
    ep: EPGroup = model.expert_parallel
    grads = {True: [], False: []}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[is_expert(name)].append(p.grad)
    sq = [torch.stack([torch.linalg.vector_norm(g) for g in gs]).square().sum() if gs else torch.zeros(())
          for gs in (grads[False], grads[True])]
    dist.all_reduce(sq[1], group=ep.group)
    total = (sq[0] + sq[1]).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads[False] + grads[True]:
        g.mul_(coef)
    return total


def _gather(t: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(ep.size)]
    dist.all_gather(parts, t.detach().contiguous(), group=ep.group)
    return torch.cat(parts)


def full_state(model: nn.Module, opt: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) with every expert gathered (collective)."""
    ep: EPGroup = model.expert_parallel
    msd = {k: (_gather(v, ep) if is_expert(k) else v.detach()).cpu() for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    state = {}
    for i, st in osd["state"].items():
        state[i] = {k: (_gather(v, ep).cpu() if torch.is_tensor(v) and v.dim() and is_expert(names[i]) else v)
                    for k, v in st.items()}
    return msd, {"state": state, "param_groups": osd["param_groups"]}


def load_state(model: nn.Module, opt: torch.optim.Optimizer, names: list[str], msd: dict, osd: dict) -> None:
    """Load full state dicts into an expert-sharded model and its optimizer."""
    ep: EPGroup = model.expert_parallel
    local = {}
    for k, v in msd.items():
        if is_expert(k):
            v = v[_local(v.shape[0], ep)]
        local[k] = v
    model.load_state_dict(local, strict=True)
    state = {}
    for i, st in osd["state"].items():
        i = int(i)
        state[i] = {k: (v[_local(v.shape[0], ep)] if torch.is_tensor(v) and v.dim() and is_expert(names[i]) else v)
                    for k, v in st.items()}
    opt.load_state_dict({"state": state, "param_groups": osd["param_groups"]})

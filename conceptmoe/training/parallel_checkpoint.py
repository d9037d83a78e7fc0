"""Checkpoints of a model trained in any parallel mode, in the single-process format (``checkpoint.py``).

DDP holds full replicas, so rank 0 saves its own; FSDP gathers full model and optimizer state
dicts onto rank 0's CPU (``get_model_state_dict`` / ``get_optimizer_state_dict`` with
``full_state_dict=True, cpu_offload=True``); expert parallelism gathers the experts from their
owners (``parallel/expert_parallel.py``). A run saved with N processes therefore resumes with any M.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..errors import UserError
from ..parallel import expert_parallel
from ..parallel.distributed import Dist, is_sharded, param_names, unwrap
from . import checkpoint as ck


def _by_name(sd: dict, names: list[str]) -> dict:
    return {"state": {names[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}


def _by_id(sd: dict, names: list[str]) -> dict:
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in sd["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]}


def save(out, model: nn.Module, opt: torch.optim.Optimizer, state: dict, d: Dist, plain: Callable[[], nn.Module]) -> None:
    """Write a checkpoint (rank 0) of a model trained in any mode; every rank must call it."""
    if getattr(model, "expert_parallel", None) is None and not is_sharded(model):
        if d.main:  # one process, or DDP: rank 0 holds the whole model and optimizer
            ck.save_checkpoint(out, unwrap(model), opt, state)
        d.barrier()
        return
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(model, options=options)  # (empty dicts on ranks other than 0)
        osd = get_optimizer_state_dict(model, opt, options=options)
        osd = _by_id(osd, param_names(opt, model)) if d.main else osd
    else:
        msd, osd = expert_parallel.full_state(model, opt, param_names(opt, model))
    if d.main:  # the gathered state goes through a plain model, in the single-process format
        shadow = plain()
        shadow.load_state_dict(msd)
        ck.save_checkpoint(out, shadow, opt, state, optimizer_state=osd)
    d.barrier()


def full_model(model: nn.Module, plain: Callable[[], nn.Module], d: Dist) -> nn.Module:
    """A plain model with the full weights of an FSDP-sharded one, on every rank (collective):
    what generation needs (it calls submodules directly, which sharded parameters refuse)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out = plain().to(d.device)
    out.load_state_dict(full)
    return out


def load(ckpt, model: nn.Module, opt: torch.optim.Optimizer, d: Dist) -> dict:
    """Restore a checkpoint written by any number of processes into this (parallelized) model."""
    if getattr(model, "expert_parallel", None) is None and not is_sharded(model):
        return ck.load_checkpoint(ckpt, unwrap(model), opt, d.device)
    state, msd, osd = ck.read_checkpoint(ckpt)
    ck.check_optimizer_fits(ckpt, opt, osd)
    try:
        if getattr(model, "expert_parallel", None) is not None:
            expert_parallel.load_state(model, opt, param_names(opt, model), msd, osd)
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, msd, options=options)
            set_optimizer_state_dict(model, opt, _by_name(osd, param_names(opt, model)), options=options)
    except (RuntimeError, ValueError, KeyError) as e:  # the bytes were read: a mismatch
        raise UserError(f"checkpoint {ckpt} does not fit this run ({str(e).strip().splitlines()[0]}); "
                        f"the checkpoint itself is intact") from None
    return state

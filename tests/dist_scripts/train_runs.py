"""Several training runs in one process group (a torchrun launch costs seconds; a tiny run less).

Usage: ``torchrun --nproc_per_node N train_runs.py RUNS.json`` (or plain ``python`` for one
process). RUNS.json is a list of dicts: the settings ``conceptmoe train`` would be given
(``resolve_train_config``: ``resume`` takes the rest from the stored run), plus test controls:

- ``stop_after``: step k; the run stops right after its step-k checkpoint (as if killed then);
- ``nan_at``: [rank, step]; that rank's first expert gradient becomes NaN at that step, after
  the gradient synchronisation (a non-finite gradient in one rank's experts only).

Each run goes through ``training.train._train`` (the code path of ``conceptmoe train``) on one
shared process group. Output lines (rank 0 unless said): ``OK <out>``, ``STOPPED <out>``,
``FAILED rank R <out>: <error>`` (every rank), and for expert-parallel runs ``REPLICAS <out>
identical`` or ``REPLICAS <out> differ <max |diff|>`` (the non-expert parameters of all ranks).
"""

import json
import sys

import torch
import torch.distributed as dist

from conceptmoe.errors import UserError
from conceptmoe.parallel import distributed, expert_parallel
from conceptmoe.training import parallel_checkpoint
from conceptmoe.training import train as train_mod
from conceptmoe.training.config import resolve_train_config


class Stopped(Exception):
    pass


ctl = {"model": None, "stop_after": None, "nan_at": None, "step": 0}
_save, _sync, _make_optimizer = parallel_checkpoint.save, expert_parallel.sync_grads, train_mod.make_optimizer


def save(out, model, opt, state, d, plain):
    _save(out, model, opt, state, d, plain)
    if state["step"] == ctl["stop_after"]:
        raise Stopped


def sync_grads(model, world):
    _sync(model, world)
    ctl["step"] += 1
    if ctl["nan_at"] and [dist.get_rank(), ctl["step"]] == ctl["nan_at"]:
        next(p for n, p in model.named_parameters() if expert_parallel.is_expert(n)).grad.view(-1)[0] = float("nan")


def make_optimizer(model, tc):
    ctl["model"] = model
    return _make_optimizer(model, tc)


parallel_checkpoint.save, expert_parallel.sync_grads, train_mod.make_optimizer = save, sync_grads, make_optimizer


def replicas(model) -> str:
    """Whether every rank holds the same non-expert parameters, bit for bit."""
    flat = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if not expert_parallel.is_expert(n)])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    worst = max(float((e - flat).abs().max()) for e in every)
    return "identical" if all(torch.equal(e, flat) for e in every) else f"differ {worst:.3g}"


runs = json.loads(open(sys.argv[1]).read())
d = distributed.setup("cpu")
failed = 0
try:
    for kw in runs:
        kw = dict(kw)
        ctl.update(stop_after=kw.pop("stop_after", None), nan_at=kw.pop("nan_at", None), step=0, model=None)
        resume, force = kw.pop("resume", False), kw.pop("force", False)
        try:
            tc = resolve_train_config({"progress": False, "device": "cpu", **kw}, resume=resume, force=force)
            train_mod._train(tc, d)
            status = "OK"
        except Stopped:
            status = "STOPPED"
        except UserError as e:
            failed += 1
            # one write with its newline: print's two writes let the other rank's line land in between
            sys.stdout.write(f"FAILED rank {d.rank} {kw['out']}: {e}\n")
            sys.stdout.flush()
            continue
        if getattr(ctl["model"], "expert_parallel", None) is not None:
            same = replicas(ctl["model"])
            if d.main:
                print(f"REPLICAS {kw['out']} {same}", flush=True)
        if d.main:
            print(f"{status} {kw['out']}", flush=True)
finally:
    distributed.teardown(d)
sys.exit(1 if failed else 0)

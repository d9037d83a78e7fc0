"""The model's stages compiled with inductor (``model.py``): which graph a call runs, and which of
dynamo's guards each graph keeps.

Two graphs a stage, as vLLM compiles its own models: one for a single row (torch specializes a
size of 1) and one dynamic in the row count, chosen by the caller's row count. The decode step's
graph (the model's ``_tail``) has one more, for a single new concept (that size specialized too).
Dynamo's guards on the weights, checked on every call, cost more than a one-row decode step's
arithmetic (a check per weight): only the shape guards and the arguments' own tensor guards are
kept. What the others would check does not change while vLLM serves: the weights, dtypes, the
model's options, no-grad. The model's warm-up runs each graph once, so none compiles while
requests wait.
"""

from __future__ import annotations

import torch


def shape_guards(entries) -> list[bool]:
    """The guards a stage keeps: shapes, and its arguments' tensor guards (sizes, dtype, device: a
    handful), not those of the weights it reads. Two stages compiled from one method with the same
    options share dynamo's cache entries: the arguments' guards are what tells the decode step's
    graph for one concept (its size specialized) from the one for several."""
    return [e.guard_type == "SHAPE_ENV" or (e.guard_type == "TENSOR_MATCH" and e.name.isidentifier())
            for e in entries]


class Stages:
    """``stages(name, rows, concepts)``: the owner's method ``_name`` as a function, compiled when
    vLLM compiles (``inductor``: vLLM's inductor options), else the method itself."""

    def __init__(self, owner, compile: bool, inductor: dict) -> None:
        self.owner, self.compile, self.inductor = owner, compile, inductor
        self.compiled: dict[tuple[str, bool, bool], object] = {}

    def __call__(self, name: str, rows: int, concepts: int | None = None):
        fn = getattr(self.owner, f"_{name}")
        if not self.compile:
            return fn
        key = (name, rows == 1, concepts == 1)
        if key not in self.compiled:
            self.compiled[key] = torch.compile(fn, dynamic=rows != 1, backend="inductor",
                                               options={**self.inductor, "guard_filter_fn": shape_guards})
        return self.compiled[key]

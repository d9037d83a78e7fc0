"""Prefill and decode latency of a trained run on its own held-out text (issue 21 frontier; CONCEPTMOE.md §4).

``bench latency`` times synthetic inputs (random ids, calibrated routers); a frontier of an
elastic run needs the latency at the compression it *realises* on text at each requested R, so
``text_latency`` times the cached path on real tokens: ``prefill`` of the first ``prefill_len``
held-out tokens, then ``decode_steps`` decode steps fed the text's next tokens (teacher forcing,
so every R decodes the same tokens). Medians of ``repeats`` after one warm-up.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..inference.steps import decode_step, prefill


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def text_latency(model, ids: torch.Tensor, ratio: float | None, prefill_len: int, decode_steps: int = 16,
                 repeats: int = 3) -> dict[str, float]:
    """ids (N,) real tokens, N >= prefill_len + decode_steps -> prefill seconds, decode ms/token, and
    the compression the prefill and the decode steps realised."""
    if len(ids) < prefill_len + decode_steps:
        raise ValueError(f"need {prefill_len + decode_steps} tokens of text, got {len(ids)}")
    dev = next(model.parameters()).device
    prompt = ids[:prefill_len][None].to(dev)  # (1, L)
    feed = ids[prefill_len:prefill_len + decode_steps].to(dev)  # (S,)
    at = {} if ratio is None else {"ratio": ratio}
    pre, dec, bounds = [], [], (0, 0)
    for rep in range(repeats + 1):  # the first pass warms up
        _sync(dev)
        t0 = time.perf_counter()
        out, st = prefill(model, prompt, **at)
        _sync(dev)
        t1 = time.perf_counter()
        n_dec = 0
        for t in feed:
            step = decode_step(model, st, t[None])
            n_dec += 0 if step.boundary is None else int(step.boundary.sum())
        _sync(dev)
        t2 = time.perf_counter()
        if rep:
            pre.append(t1 - t0)
            dec.append((t2 - t1) / decode_steps)
        bounds = (0 if out.boundary is None else int(out.boundary.sum()), n_dec)
    concept = out.boundary is not None
    return {"prefill_s": statistics.median(pre), "decode_ms_per_token": 1e3 * statistics.median(dec),
            "prefill_tokens": prefill_len, "decode_steps": decode_steps,
            "prefill_compression": prefill_len / bounds[0] if concept else 1.0,
            "decode_compression": decode_steps / max(bounds[1], 1) if concept else 1.0}

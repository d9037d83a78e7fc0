"""One request's next token from its row of logits: vLLM's sampling extras and log-probabilities.

The engine (``engine.py``) hands each running row's logits here with the row's ``Request``. In
order, as vLLM applies them: ``logit_bias`` is added; ``repetition_penalty`` divides positive
logits and multiplies negative ones of every token already in the prompt or the completion;
``frequency_penalty`` (times the count) and ``presence_penalty`` (once) are subtracted for every
token already in the completion; before ``min_tokens`` completion tokens, end-of-text and
``stop_token_ids`` are masked out. Then greedy (temperature 0) or seeded top-k / nucleus
sampling (``inference/generate.py``'s ``sample``, so a seeded request draws what
``model.generate`` draws). A row whose extras are all neutral skips every step above.

Log-probabilities are those of the model (the log-softmax of its raw logits, as vLLM's default
``raw_logprobs``), not of the processed distribution: the numbers lm-eval's loglikelihood tasks
need. Shape legend: V vocabulary, T prompt positions.
"""

from __future__ import annotations

import torch

from ..inference.generate import sample

LOGPROB_CHUNK = 256  # prompt positions whose (T, V) log-softmax is held at once


def is_plain(req) -> bool:
    """No extra changes the logits: the batched greedy argmax stands for this row."""
    return (req.repetition_penalty == 1.0 and not req.presence_penalty and not req.frequency_penalty
            and not req.logit_bias and len(req.generated) >= req.min_tokens)


def process(logits: torch.Tensor, req, eos: list[int]) -> torch.Tensor:
    """(V,) raw logits -> (V,) fp32 logits with ``req``'s bias, penalties and min_tokens applied."""
    x = logits.float().clone()
    V = x.shape[0]
    if req.logit_bias:
        ids = torch.tensor(list(req.logit_bias), dtype=torch.long, device=x.device)
        x[ids] += torch.tensor(list(req.logit_bias.values()), dtype=x.dtype, device=x.device)
    if req.repetition_penalty != 1.0:
        seen = torch.zeros(V, dtype=torch.bool, device=x.device)
        seen[torch.tensor(req.prompt + req.generated, dtype=torch.long, device=x.device)] = True
        p = req.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    if (req.presence_penalty or req.frequency_penalty) and req.generated:
        counts = torch.bincount(torch.tensor(req.generated, device=x.device), minlength=V)[:V].to(x.dtype)
        x = x - req.frequency_penalty * counts - req.presence_penalty * (counts > 0).to(x.dtype)
    if len(req.generated) < req.min_tokens:
        ends = [t for t in list(eos) + list(req.stop_token_ids) if 0 <= t < V]
        if ends:
            x[torch.tensor(ends, dtype=torch.long, device=x.device)] = float("-inf")
    return x


def pick(logits: torch.Tensor, req) -> int:
    """One token from (V,) processed logits at ``req``'s temperature, top-k, top-p and generator."""
    if not torch.isfinite(logits).any():
        raise ValueError("no token is left to sample (every logit is -inf or not a number)")
    if req.temperature == 0:
        return int(logits.argmax())
    return int(sample(logits[None], req.temperature, req.top_k, req.top_p, req.generator)[0])


def top_logprobs(logprobs: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(V,) log-probabilities -> (the token's, the k most likely as (id, logprob), best first)."""
    top = logprobs.topk(k) if k > 0 else None
    best = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return float(logprobs[token]), best


def prompt_logprobs(model, hidden: torch.Tensor, ids: list[int], k: int) -> list:
    """Log-probabilities of each prompt token given the ones before it, from the last layer's
    states ``hidden`` (T, D) of one row: [None, (lp, top), ...] (the first token has no context)."""
    out: list = [None]
    for s in range(0, len(ids) - 1, LOGPROB_CHUNK):
        e = min(s + LOGPROB_CHUNK, len(ids) - 1)
        lp = model.lm_head(model.norm(hidden[s:e])).float().log_softmax(-1)  # (t, V)
        for i in range(e - s):
            out.append(top_logprobs(lp[i], ids[s + i + 1], k))
    return out


def sample_row(r, logits: torch.Tensor, greedy: int) -> tuple[int, tuple | None]:
    """(token, its log-probabilities or None) for row ``r`` from its raw logits (V,)."""
    if r.temperature == 0 and is_plain(r):
        tok = greedy
    else:
        tok = pick(process(logits, r, r.eos), r)
    lp = None
    if r.logprobs is not None:
        lp = top_logprobs(logits.float().log_softmax(-1), tok, r.logprobs)
    return tok, lp

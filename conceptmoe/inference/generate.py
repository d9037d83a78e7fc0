"""Batched text generation with the concept-level KV cache (CONCEPTMOE.md §4).

``generate(model, input_ids, ...)`` is what ``model.generate`` calls. Prompts of different
lengths come as a padded (B, T) batch with ``attention_mask`` (1 = real token); each row's
real tokens must be contiguous (left padding, the Hugging Face convention, or right padding).
Internally rows are moved to the left edge (right padding) and the caches are ragged: each
row has its own token count and, for ConceptMoE, its own concept count (``cache.py``).
The result is ``input_ids`` followed by the new tokens: (B, T + max_new_tokens); rows that
emitted ``eos_token_id`` (an id or a list of ids) are filled with it (the first) afterwards.

``stream(...)`` yields one ``Step`` per new token (for the CLI's streaming output);
``use_cache=False`` recomputes the full forward pass every step: the slow, obviously-correct
reference the cached path is tested against. The model runs in eval mode while generating
(deterministic boundaries p >= 0.5) and its mode is restored afterwards.

Shape legend: B batch, T prompt length, N new tokens, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..model.lm import LanguageModel
from .steps import decode_step, prefill

PREALLOCATE = 4096  # new tokens' cache entries reserved at prefill; beyond that the cache grows by blocks


@dataclass
class Step:
    """One generated token per row."""

    tokens: torch.Tensor  # (B,) the new token of each row (eos for finished rows)
    finished: torch.Tensor  # (B,) bool: the row has emitted eos (this step included)
    boundary: torch.Tensor | None  # (B,) bool: the *previous* token started a concept (ConceptMoE)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row from logits (B, V): greedy at temperature 0, else top-k / nucleus sampling."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (got {temperature})")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (got {top_k})")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (got {top_p})")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix reaching top_p
        # the most likely token always stays (vLLM's rule): a tiny top_p (1e-46 is 0 in fp32) is greedy
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def compact(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's real tokens to the left edge: (right-padded ids (B, T), lengths (B,))."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (B, T) with T >= 1 (got shape {tuple(input_ids.shape)})")
    B, T = input_ids.shape
    if attention_mask is None:
        return input_ids, torch.full((B,), T, device=input_ids.device)
    m = attention_mask.to(input_ids.device).bool()
    if m.shape != input_ids.shape:
        raise ValueError("attention_mask must have the shape of input_ids")
    lengths = m.sum(1)
    if int(lengths.min()) < 1:
        raise ValueError("every row needs at least one real token (attention_mask row is all zero)")
    start = m.float().argmax(1)  # first real token
    ar = torch.arange(T, device=m.device)[None]
    if not torch.equal((ar >= start[:, None]) & (ar < (start + lengths)[:, None]), m):
        raise ValueError("attention_mask: each row's real tokens must be contiguous")
    idx = (start[:, None] + ar).clamp_max(T - 1)
    ids = torch.gather(input_ids, 1, idx)
    ids = torch.where(torch.arange(T, device=m.device)[None] < lengths[:, None], ids, 0)
    return ids, lengths


def _forward_last(model, seqs: list[list[int]], device, pixel_values=None, ratio=None,
                  extrapolate: bool = False) -> torch.Tensor:
    """Full forward over right-padded sequences; logits at each row's last token (B, V)."""
    lens = torch.tensor([len(s) for s in seqs], device=device)
    ids = torch.zeros(len(seqs), int(lens.max()), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, device=device)
    extra = {"ratio": ratio, "extrapolate": extrapolate} if ratio is not None else {}
    logits = model(ids, pixel_values=pixel_values, **extra).logits if pixel_values is not None else model(ids, **extra).logits
    return logits[torch.arange(len(seqs), device=device), lens - 1]


@torch.no_grad()
def stream(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
           attention_mask: torch.Tensor | None = None, use_cache: bool = True,
           generator: torch.Generator | None = None, state_out: list | None = None,
           pixel_values: torch.Tensor | None = None, ratio: float | torch.Tensor | None = None,
           extrapolate: bool = False) -> Iterator[Step]:
    """Yield one ``Step`` per generated token. ``state_out`` (a list) receives the inference state.
    ``pixel_values`` (B, N, C, H, W): images for the prompts' placeholders (``model/vision.py``).
    ``ratio``: an elastic ConceptMoE's compression R, one number or one per row (B,); outside the
    trained range only with ``extrapolate`` (``model/elastic.py``: ``check_ratio``)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    ids, lengths = compact(input_ids, attention_mask)
    B, dev = ids.shape[0], ids.device
    eos = _eos_ids(eos_token_id, dev)
    was_training = model.training
    model.eval()
    try:
        seqs = [ids[i, :int(lengths[i])].tolist() for i in range(B)]
        boundary = None
        if use_cache:
            # The cache grows by blocks as needed: a huge max_new_tokens must not be allocated up front.
            out, state = prefill(model, ids, lengths, extra_capacity=min(max_new_tokens, PREALLOCATE),
                                 pixel_values=pixel_values, ratio=ratio, extrapolate=extrapolate)
            logits = out.logits
            if state_out is not None:
                state_out.append(state)
        else:
            logits = _forward_last(model, seqs, dev, pixel_values, ratio, extrapolate)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        for n in range(max_new_tokens):
            tok = sample(logits, temperature, top_k, top_p, generator)
            if eos is not None:
                tok = torch.where(finished, torch.full_like(tok, int(eos[0])), tok)
                finished = finished | torch.isin(tok, eos)
            yield Step(tok, finished.clone(), boundary)
            if n == max_new_tokens - 1 or bool(finished.all()):
                return
            if use_cache:
                out = decode_step(model, state, tok)
                logits, boundary = out.logits, out.boundary
            else:
                for i, t in enumerate(tok.tolist()):
                    seqs[i].append(t)
                logits = _forward_last(model, seqs, dev, pixel_values, ratio, extrapolate)
    finally:
        model.train(was_training)


def _eos_ids(eos_token_id: int | list[int] | None, device) -> torch.Tensor | None:
    """(n,) the ids that end a row, or None."""
    if eos_token_id is None or (isinstance(eos_token_id, (list, tuple)) and not eos_token_id):
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
             attention_mask: torch.Tensor | None = None, use_cache: bool = True,
             generator: torch.Generator | None = None, pixel_values: torch.Tensor | None = None,
             ratio: float | torch.Tensor | None = None, extrapolate: bool = False) -> torch.Tensor:
    """The prompt followed by ``max_new_tokens`` new tokens per row: (B, T + N). ``ratio``: an
    elastic ConceptMoE's R, one number or a tensor of one per row."""
    new = [s.tokens for s in stream(model, input_ids, max_new_tokens, temperature, top_k, top_p,
                                    eos_token_id, attention_mask, use_cache, generator, pixel_values=pixel_values,
                                    ratio=ratio, extrapolate=extrapolate)]
    B, N = input_ids.shape[0], max_new_tokens
    eos = _eos_ids(eos_token_id, "cpu")
    out = torch.full((B, N), int(eos[0]) if eos is not None else 0, dtype=input_ids.dtype, device=input_ids.device)
    if new:
        out[:, :len(new)] = torch.stack(new, 1)
    return torch.cat([input_ids, out], 1)


def _generate_method(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                     top_k: int | None = None, top_p: float | None = None,
                     eos_token_id: int | list[int] | None = None, attention_mask: torch.Tensor | None = None,
                     use_cache: bool = True, generator: torch.Generator | None = None,
                     pixel_values: torch.Tensor | None = None, ratio: float | torch.Tensor | None = None,
                     extrapolate: bool = False) -> torch.Tensor:
    """Prompt + ``max_new_tokens`` sampled tokens (B, T + N), KV-cached; see ``inference/generate.py``."""
    return generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id,
                    attention_mask, use_cache, generator, pixel_values, ratio, extrapolate)


# The dependency runs one way (inference uses the model), so the models get their ``generate``
# method from here rather than importing this module. ``import conceptmoe`` (which any import
# of a submodule runs first) loads this module, so every model has the method.
LanguageModel.generate = _generate_method

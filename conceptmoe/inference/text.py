"""Streaming text out of a run: what ``conceptmoe generate`` prints (CONCEPTMOE.md §4).

``stream_text(model, tok, prompt, ...)`` yields the new text piece by piece as tokens are
sampled with the KV cache. With ``show_concepts`` (ConceptMoE) each token that starts a
concept is preceded by ``MARK``; a token's boundary is known only once it has been fed to the
model, so text is released up to the last fed token (and the final token is fed once more at
the end). ``tok`` is any tokenizer with ``encode(text).ids`` and ``decode(ids)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from .generate import stream
from .steps import decode_step

MARK = "|"  # printed before each token that starts a concept (show_concepts)


@dataclass
class TextStats:
    """Filled in by ``stream_text`` as it runs."""

    new_tokens: int = 0
    seconds: float = 0.0
    tokens: int = 0  # tokens the cache has seen (prompt + generated, fed)
    concepts: int | None = None  # concepts over those tokens (ConceptMoE)
    ratio: float | None = None  # the R asked of an elastic ConceptMoE

    def summary(self) -> str:
        note = f"{self.new_tokens} tokens in {self.seconds:.2f} s " \
               f"({self.new_tokens / max(self.seconds, 1e-9):.1f} tok/s)"
        if self.concepts is not None:
            note += f", {self.concepts} concepts over {self.tokens} tokens " \
                    f"(R = {self.tokens / max(self.concepts, 1):.2f}" + \
                    (f", requested {self.ratio:g})" if self.ratio is not None else ")")
        return note


def render(tok, ids: list[int], starts: set[int], show: bool) -> str:
    """Text of ``ids``; with ``show`` each concept is decoded on its own, preceded by the mark."""
    if not show:
        return tok.decode(ids)
    out, seg = [], []
    for i, t in enumerate(ids):
        if i in starts and seg:
            out.append(tok.decode(seg))
            seg = []
        if i in starts:
            out.append(MARK)
        seg.append(t)
    out.append(tok.decode(seg))
    return "".join(out)


def stream_text(model, tok, prompt: str, max_new_tokens: int, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None, show_concepts: bool = False,
                stats: TextStats | None = None, eos_token_id: int | list[int] | None = None,
                ratio: float | None = None, extrapolate: bool = False) -> Iterator[str]:
    """Yield the continuation of ``prompt`` as text pieces (concatenated: the whole new text);
    it ends early at ``eos_token_id`` (the run's end-of-text), which is not printed.
    ``ratio``: the compression R asked of an elastic ConceptMoE (outside its trained range only
    with ``extrapolate``)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    ids = tok.encode(prompt).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    stats = TextStats() if stats is None else stats
    stats.ratio = ratio
    concept = model.cfg.is_concept
    show = show_concepts and concept
    dev = next(model.parameters()).device
    states: list = []
    all_ids, printed = list(ids), ""
    t0 = time.perf_counter()

    def release(final: bool) -> str:
        nonlocal printed
        st = states[0]
        decided = len(all_ids) if (final or not show) else st.tokens.lengths[0]
        starts = set(st.boundaries[0]) if show else set()
        text = render(tok, all_ids[:decided], starts, show)
        if not final:
            text = text.rstrip("\ufffd")  # a multi-byte character still incomplete
        if not text.startswith(printed):
            return ""
        piece, printed = text[len(printed):], text
        return piece

    x = torch.tensor([ids], device=dev)
    ended = False
    for step in stream(model, x, max_new_tokens, temperature, top_k, top_p, eos_token_id=eos_token_id,
                       generator=generator, state_out=states, ratio=ratio, extrapolate=extrapolate):
        if bool(step.finished[0]):  # end of text: not printed; the token before it has been fed
            stats.new_tokens += 1
            ended = True
            break
        all_ids.append(int(step.tokens[0]))
        stats.new_tokens += 1
        yield release(False)
    if show and not ended:  # feed the last token too, to learn whether it starts a concept
        decode_step(model, states[0], torch.tensor([all_ids[-1]], device=dev))
    yield release(True)
    stats.seconds = time.perf_counter() - t0
    if concept:
        stats.tokens, stats.concepts = states[0].tokens.lengths[0], len(states[0].boundaries[0])

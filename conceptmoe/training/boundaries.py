"""Where a trained ConceptMoE puts concept boundaries (CONCEPTMOE.md §2, item 2: the chunk module).

``find_boundaries(run_dir, text)`` runs the model in eval mode (deterministic boundaries,
p_t >= 0.5) over the text in windows of the run's training length (every window starts a new
concept, as in training) and returns the concepts as text spans that concatenate back to the
input. ``render_terminal`` colours the spans (or separates them with ``|`` without colour);
``render_html`` writes a self-contained page with the boundary probability and token count of
every concept in its tooltip.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from .checkpoint import load_run

# Background colours cycled over concepts (ANSI 256-colour codes and their HTML equivalents).
_ANSI = (153, 223, 194, 217, 189, 229)
_HTML = ("#afd7ff", "#ffd7af", "#d7ffd7", "#ffafaf", "#d7d7ff", "#ffffaf")


@dataclass
class Concept:
    text: str  # the characters this concept covers
    n_tokens: int
    p: float  # boundary probability at the concept's first token


@dataclass
class BoundaryResult:
    concepts: list[Concept]
    n_tokens: int
    target_ratio: float
    run: str

    @property
    def compression(self) -> float:
        """Realized tokens per concept on this text."""
        return self.n_tokens / max(len(self.concepts), 1)

    def summary(self) -> str:
        return (f"{self.n_tokens} tokens -> {len(self.concepts)} concepts: compression "
                f"{self.compression:.2f} tokens/concept (target R = {self.target_ratio:g})")


@torch.no_grad()
def find_boundaries(run_dir: str | Path, text: str, device: str = "auto") -> BoundaryResult:
    """Chunk ``text`` with a trained ConceptMoE run."""
    if not text.strip():
        raise UserError("the text to chunk is empty")
    model, cfg, tok, run_cfg = load_run(run_dir, device)
    if not cfg.is_concept:
        raise UserError(f"{run_dir} is a plain MoE run: it has no concept boundaries")
    enc = tok.encode(text)
    ids = torch.tensor(enc.ids, dtype=torch.long)
    seq_len = int(run_cfg.get("train", {}).get("seq_len", 256))
    dev = next(model.parameters()).device
    p_all, b_all = [], []
    for start in range(0, len(ids), seq_len):
        out = model(ids[start:start + seq_len][None].to(dev))
        p_all.append(out.chunks.p[0].float().cpu())
        b_all.append(out.boundaries[0].cpu())
    p, b = torch.cat(p_all), torch.cat(b_all)  # (T,)
    starts = torch.nonzero(b).flatten().tolist()
    char_at = [enc.offsets[i][0] for i in starts] + [len(text)]
    char_at[0] = 0  # leading text the tokenizer folded into the first token
    ends = starts[1:] + [len(ids)]
    concepts = [Concept(text[char_at[j]:char_at[j + 1]], ends[j] - starts[j], float(p[starts[j]]))
                for j in range(len(starts))]
    return BoundaryResult(concepts, len(ids), cfg.compression_ratio, str(run_dir))


def render_terminal(res: BoundaryResult, color: bool = True) -> str:
    """Concepts as alternating background colours (or ``|``-separated), then the summary."""
    if color:
        body = "".join(f"\x1b[30;48;5;{_ANSI[j % len(_ANSI)]}m{c.text}\x1b[0m"
                       for j, c in enumerate(res.concepts))
    else:
        body = "|".join(c.text for c in res.concepts)
    return f"{body}\n\n{res.summary()}"


def render_html(res: BoundaryResult) -> str:
    """A self-contained HTML page (inline CSS, no scripts) showing the concepts."""
    spans = "".join(
        f'<span style="background:{_HTML[j % len(_HTML)]}" title="concept {j}: {c.n_tokens} tokens, '
        f'p = {c.p:.2f}">{html.escape(c.text)}</span>' for j, c in enumerate(res.concepts))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ConceptMoE boundaries</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }}
.text {{ font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.7;
         border: 1px solid #ddd; padding: 1em; }}
.text span {{ border-radius: 3px; }}
</style></head><body>
<h1>Concept boundaries</h1>
<p>Run: <code>{html.escape(res.run)}</code><br>{html.escape(res.summary())}</p>
<p>Each coloured span is one concept: the concept model sees it as a single position.
Hover a span for its token count and boundary probability.</p>
<div class="text">{spans}</div>
</body></html>
"""

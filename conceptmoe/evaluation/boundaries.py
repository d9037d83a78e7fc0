"""Where a trained ConceptMoE puts concept boundaries (CONCEPTMOE.md §2, item 2: the chunk module).

``find_boundaries(run_dir, text)`` runs the model in eval mode (deterministic boundaries,
p_t >= 0.5) over the text in windows of the run's training length (every window starts a new
concept, as in training) and returns the concepts as text spans that concatenate back to the
input. ``render_terminal`` colours the spans (or separates them with ``|`` without colour);
``render_html`` writes a self-contained page with the boundary probability and token count of
every concept in its tooltip.

The vision-language digits task (``--data vlm-digits``) has its own view:
``find_vlm_boundaries(run_dir, n)`` runs a ConceptMoE trained on ``--data vlm-digits`` in eval
mode (deterministic boundaries) over ``n`` held-out examples, one per row from position 0, and
returns for each the images (pixels and the concept of every patch) and the text as concept
spans. ``render_vlm_terminal`` prints each image as its grid of concept letters next to the
``|``-separated text; ``render_vlm_html`` draws each image as an SVG patch grid whose patches
are outlined in their concept's colour (a thick dark corner marks a patch that starts a concept),
followed by the text spans in the same colours, so a concept spanning an image's last patches
and the first words shows as one colour across both.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..model.elastic import require_ratio
from ..data.digits import eval_examples, load_digits
from ..training.checkpoint import load_run

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
def find_boundaries(run_dir: str | Path, text: str, device: str = "auto", ratio: float | None = None,
                    extrapolate: bool = False) -> BoundaryResult:
    """Chunk ``text`` with a trained ConceptMoE run (an elastic one at ``ratio``)."""
    if not text.strip():
        raise UserError("the text to chunk is empty")
    model, cfg, tok, run_cfg = load_run(run_dir, device)
    if not cfg.is_concept:
        raise UserError(f"{run_dir} is a plain MoE run: it has no concept boundaries")
    ratio = require_ratio(cfg, ratio, extrapolate)
    extra = {} if ratio is None else {"ratio": ratio, "extrapolate": extrapolate}
    enc = tok.encode(text)
    ids = torch.tensor(enc.ids, dtype=torch.long)
    seq_len = int(run_cfg.get("train", {}).get("seq_len", 256))
    dev = next(model.parameters()).device
    p_all, b_all = [], []
    for start in range(0, len(ids), seq_len):
        out = model(ids[start:start + seq_len][None].to(dev), **extra)
        p_all.append(out.chunks.p[0].float().cpu())
        b_all.append(out.boundaries[0].cpu())
    p, b = torch.cat(p_all), torch.cat(b_all)  # (T,)
    starts = torch.nonzero(b).flatten().tolist()
    char_at = [enc.offsets[i][0] for i in starts] + [len(text)]
    char_at[0] = 0  # leading text the tokenizer folded into the first token
    ends = starts[1:] + [len(ids)]
    concepts = [Concept(text[char_at[j]:char_at[j + 1]], ends[j] - starts[j], float(p[starts[j]]))
                for j in range(len(starts))]
    return BoundaryResult(concepts, len(ids), ratio or cfg.compression_ratio, str(run_dir))


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


# The digits task: images and text in one view.

_VLM_OUTLINE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_VLM_SPAN = ("#afd7ff", "#ffd7af", "#d7ffd7", "#ffafaf", "#d7d7ff", "#ffffaf", "#ffd7ff", "#afffff")


@dataclass
class VlmView:
    images: list[np.ndarray]  # (C, H, W) each
    patch_concepts: list[list[int]]  # concept index of each patch, per image (row-major)
    patch_starts: list[list[bool]]  # the patch starts a concept
    text: list[tuple[str, int]]  # (token, concept index) of the text positions
    compression_image: float
    compression_text: float


@torch.no_grad()
def find_vlm_boundaries(run_dir: str | Path, n: int = 4, device: str = "auto") -> list[VlmView]:
    model, cfg, tok, _ = load_run(run_dir, device)
    if not cfg.is_concept:
        raise UserError(f"{run_dir} is a plain MoE run: it has no concept boundaries")
    digits = load_digits()
    dev = next(model.parameters()).device
    views = []
    for ex in eval_examples(digits, n, cfg.n_patches):
        ids = torch.tensor([ex.ids], device=dev)
        pix = torch.from_numpy(digits.images[ex.images])[None].to(dev)
        b = model(ids, pixel_values=pix).boundaries[0].cpu()
        cidx = (b.long().cumsum(0) - 1).tolist()
        img = [i for i, t in enumerate(ex.ids) if t == cfg.image_token_id]
        S = cfg.n_patches
        per = [img[k * S:(k + 1) * S] for k in range(len(ex.images))]
        text = [(tok.id_to_token(t), cidx[i]) for i, t in enumerate(ex.ids) if t != cfg.image_token_id]
        n_img_c = int(b[img].sum())
        n_txt = len(ex.ids) - len(img)
        views.append(VlmView([digits.images[i] for i in ex.images], [[cidx[i] for i in pos] for pos in per],
                             [[bool(b[i]) for i in pos] for pos in per], text,
                             len(img) / max(n_img_c, 1), n_txt / max(int(b.sum()) - n_img_c, 1)))
    return views


def _letter(j: int) -> str:
    return "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[j % 52]


def render_vlm_terminal(views: list[VlmView]) -> str:
    """Each image as a grid of concept letters (one per patch), then the text split at concepts."""
    out = []
    for k, v in enumerate(views):
        g = int(len(v.patch_concepts[0]) ** 0.5)
        grids = [[" ".join(_letter(c[r * g + q]) for q in range(g)) for r in range(g)] for c in v.patch_concepts]
        out.append(f"example {k}: images (concept of each patch)")
        out += ["   ".join(grid[r] for grid in grids) for r in range(g)]
        words, last = [], None
        for w, c in v.text:
            words.append(("| " if c != last and last is not None else "") + f"{w}")
            last = c
        out.append("text: " + " ".join(words))
        out.append(f"compression image {v.compression_image:.2f}, text {v.compression_text:.2f}\n")
    return "\n".join(out)


def _svg(img: np.ndarray, concepts: list[int], starts: list[bool], px: int = 14) -> str:
    c, h, w = img.shape
    g = int(len(concepts) ** 0.5)
    p = h // g
    cells = []
    for y in range(h):
        for x in range(w):
            v = int(255 * (1 - float(img[:, y, x].mean())))
            cells.append(f'<rect x="{x * px}" y="{y * px}" width="{px}" height="{px}" fill="rgb({v},{v},{v})"/>')
    for i, (cj, st) in enumerate(zip(concepts, starts)):
        x, y = (i % g) * p * px, (i // g) * p * px
        cells.append(f'<rect x="{x + 1.5}" y="{y + 1.5}" width="{p * px - 3}" height="{p * px - 3}" fill="none" '
                     f'stroke="{_VLM_OUTLINE[cj % len(_VLM_OUTLINE)]}" stroke-width="3"><title>patch {i}: concept {cj}'
                     f'{" (starts it)" if st else ""}</title></rect>')
        if st:
            cells.append(f'<rect x="{x}" y="{y}" width="6" height="6" fill="#000"/>')
    return f'<svg width="{w * px}" height="{h * px}" xmlns="http://www.w3.org/2000/svg">{"".join(cells)}</svg>'


def render_vlm_html(views: list[VlmView], run: str) -> str:
    blocks = []
    for k, v in enumerate(views):
        imgs = " ".join(_svg(im, c, s) for im, c, s in zip(v.images, v.patch_concepts, v.patch_starts))
        spans = " ".join(f'<span style="background:{_VLM_SPAN[c % len(_VLM_SPAN)]};border-bottom:3px solid '
                         f'{_VLM_OUTLINE[c % len(_VLM_OUTLINE)]}" title="concept {c}">{html.escape(w)}</span>' for w, c in v.text)
        blocks.append(f'<div class="ex"><h3>held-out example {k}</h3><div>{imgs}</div><p class="text">{spans}</p>'
                      f'<p>compression: image {v.compression_image:.2f}, text {v.compression_text:.2f} '
                      f'tokens/concept</p></div>')
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ConceptMoE boundaries: images and text</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }}
.ex {{ border: 1px solid #ddd; padding: 1em; margin-bottom: 1em; }}
svg {{ margin-right: 1em; }}
.text {{ font-family: ui-monospace, monospace; line-height: 2; }}
</style></head><body>
<h1>Concept boundaries over image patches and text</h1>
<p>Run: <code>{html.escape(run)}</code>. Each image is an 8x8 digit cut into 2x2-pixel patches (one
sequence position each); a patch's outline has its concept's colour and a black corner marks the
patch that starts a concept. The text that follows uses the same colours: the concept model sees
each colour run as one position, and one concept may cover the last patches and the first words.</p>
{"".join(blocks)}
</body></html>
"""

"""Images in the token sequence: patch embedding and placement (CONCEPTMOE.md §5, vision-language).

The paper's vision-language ConceptMoE chunks image and text positions together. Images enter
the way transformers' LLaVA-style VLMs present them: ``input_ids`` hold ``image_token_id``
placeholders, ``n_patches`` consecutive ones per image, and ``pixel_values`` (B, N, C, H, W)
hold each row's images in order (rows with fewer images pad N with anything; a row uses as
many images as it has placeholder runs). ``ImageEmbed`` splits an image into P x P patches
(row-major), embeds each linearly into d_model and adds a learned position-in-image embedding
and a learned modality embedding; ``embed_inputs`` writes those vectors over the placeholder
positions of the token embeddings. Everything after the embedding (encoder, chunk router,
concept model, dechunk, decoder) is shared and unchanged, so a concept may span both
modalities.

Shape legend: B batch, T tokens, N images per row (max), C channels, H/W pixels,
P patch size, S patches per image, D d_model.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig


class ImageEmbed(nn.Module):
    """Patch embedding: (n, C, H, W) images -> (n, S, D) patch vectors."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.patch = cfg.patch_size
        n_in = cfg.image_channels * cfg.patch_size ** 2
        self.proj = nn.Linear(n_in, cfg.d_model)
        # Unit-scale start: with the LM's std 0.02 (and torch's bias init) the pixel-dependent
        # part of a patch vector is drowned by the bias and the digits task does not learn to
        # read images in a few hundred steps (first-digit accuracy at chance vs 0.92 after 200).
        nn.init.normal_(self.proj.weight, std=n_in ** -0.5)
        nn.init.zeros_(self.proj.bias)
        self.pos = nn.Parameter(torch.randn(cfg.n_patches, cfg.d_model) * 0.02)  # where in the image
        self.modality = nn.Parameter(torch.randn(cfg.d_model) * 0.02)  # "this position is an image"

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(patchify(images, self.patch)) + self.pos + self.modality


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """(n, C, H, W) -> (n, S, C·P·P): non-overlapping P x P patches in row-major order."""
    n, c, h, w = images.shape
    x = images.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # (n, H/P, W/P, C, P, P)
    return x.reshape(n, (h // p) * (w // p), c * p * p)


def image_mask(cfg: ModelConfig, input_ids: torch.Tensor) -> torch.Tensor | None:
    """(B, T) bool: the image (patch) positions; None for a text-only model."""
    return input_ids == cfg.image_token_id if cfg.image_size else None


def images_per_row(cfg: ModelConfig, mask: torch.Tensor) -> torch.Tensor:
    """(B,) number of images each row places; its placeholders must come in whole images."""
    counts = mask.sum(1)
    if bool((counts % cfg.n_patches).any()):
        raise ValueError(f"image placeholders must come in runs of {cfg.n_patches} per image "
                         f"(row counts {counts.tolist()})")
    return counts // cfg.n_patches


def embed_inputs(model: nn.Module, input_ids: torch.Tensor,
                 pixel_values: torch.Tensor | None = None) -> torch.Tensor:
    """Token embeddings (B, T, D) with each image's patch vectors at its placeholders.

    Without ``pixel_values`` this is exactly ``model.embed(input_ids)`` (text-only path).
    """
    x = model.embed(input_ids)  # (B, T, D)
    if pixel_values is None:
        return x
    cfg = model.cfg
    if not cfg.image_size:
        raise ValueError("pixel_values given to a text-only model (ModelConfig.image_size = 0)")
    mask = image_mask(cfg, input_ids)
    n_img = images_per_row(cfg, mask)  # (B,)
    if n_img.numel() and int(n_img.max()) > pixel_values.shape[1]:
        raise ValueError(f"input_ids place up to {int(n_img.max())} images per row but pixel_values "
                         f"holds {pixel_values.shape[1]}")
    used = torch.arange(pixel_values.shape[1], device=x.device)[None] < n_img[:, None]  # (B, N)
    patches = model.vision(pixel_values[used].to(x.dtype))  # (n, S, D), rows then images in order
    return x.masked_scatter(mask[..., None], patches.reshape(-1, x.shape[-1]))


def modality_stats(mask: torch.Tensor | None, b: torch.Tensor, valid: torch.Tensor | None = None) -> dict[str, float]:
    """Realised tokens per concept on image and on text positions (boundaries b (B, T)).

    A concept is counted in the modality of its boundary token.
    """
    if mask is None:
        return {}
    valid = torch.ones_like(b) if valid is None else valid
    out = {}
    for name, where in (("image", mask & valid), ("text", ~mask & valid)):
        n = int(where.sum())
        if n:
            out[f"compression_{name}"] = n / max(int((b & where).sum()), 1)
    return out

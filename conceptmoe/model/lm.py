"""The two language models: a plain fine-grained MoE and ConceptMoE (CONCEPTMOE.md §2, §2b).

``build_model(cfg)`` returns ``MoELM`` or ``ConceptMoELM``. Both take ``input_ids`` (B, T) and
optional ``labels`` (B, T) in the Hugging Face convention (the model shifts them: logits at t
predict labels at t+1; -100 is ignored) and return a ``ModelOutput``.

ConceptMoE forward: embed -> encoder blocks (token rate) -> chunk (p, boundaries, concepts)
-> concept blocks on the padded (B, C, D) concepts, looped ``concept_loops`` times
-> dechunk (EMA scan, STE) -> decoder blocks (joint decoding in the last ``n_joint_layers``)
-> norm -> LM head. The dechunk carries the concept output (reference) or, with
``dechunk_source="update"``, the concept model's update c_out - c_in.
RoPE choice: concepts use their concept index 0..C-1 as position (tokens use t).
Images (``pixel_values``, placeholder tokens in ``input_ids``; ``vision.py``) replace their
placeholders' embeddings; those positions get no LM loss, and ``aux`` then reports the
realised compression per modality.

Shape legend: B batch, T tokens, C concepts, D d_model, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention, RMSNorm, rope_tables
from .chunking import ChunkRouter, Chunks, boundaries, dechunk, gather_concepts, ratio_loss, ratio_loss_fg
from .config import ModelConfig
from .health import HealthTally
from .elastic import RatioEmbedding, RatioTerms, as_ratios, check_ratio, per_sequence_ratio_loss, ratio_values
from .linear_ce import linear_cross_entropy
from .moe import MoE, MoEAux, compute_dtype
from .stats import ChunkStats, Reduce, router_losses, stats_vector
from .vision import ImageEmbed, embed_inputs, image_mask, modality_stats


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # (B, T, V); None when the training loss was fused (``loss_only``)
    loss: torch.Tensor | None = None  # CE + weighted aux terms (None without labels)
    aux: dict[str, torch.Tensor | float] = field(default_factory=dict)
    boundaries: torch.Tensor | None = None  # (B, T) bool for ConceptMoE, None for MoE
    chunks: Chunks | None = None  # full chunking detail (ConceptMoE only)


def valid_rows(mask: torch.Tensor) -> torch.Tensor:
    """The flat indices of the True positions of a (B, T) mask."""
    return mask.reshape(-1).nonzero().squeeze(1)


class Block(nn.Module):
    """Pre-norm attention + pre-norm MoE feed-forward (optionally with joint decoding)."""

    def __init__(self, cfg: ModelConfig, n_experts: int, top_k: int, joint: bool = False) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, joint=joint)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = MoE(cfg.d_model, n_experts, top_k, cfg.expert_hidden, cfg.n_shared_experts,
                       cfg.shared_size, cfg.shared_expert_gate, cfg.norm_topk_prob)

    def ffn(self, x: torch.Tensor, valid: torch.Tensor | None, dispatch: str) -> tuple[torch.Tensor, MoEAux]:
        """MoE on the valid positions of x (B, T, D); padding positions get zeros. ``valid``: a
        (B, T) bool mask, or the flat indices of its True positions (``valid_rows``: computed once
        for all the concept layers)."""
        h = self.moe_norm(x)
        flat = h.reshape(-1, h.shape[-1])
        if valid is None:
            y, aux = self.moe(flat, dispatch)
            return x + y.view_as(h), aux
        rows = valid_rows(valid) if valid.dtype == torch.bool else valid
        # index_select / index_copy, not boolean indexing: the mask's nonzero once, and backwards
        # that are a plain index_add and index_select instead of an accumulating index_put_.
        y, aux = self.moe(flat.index_select(0, rows), dispatch)
        return x + flat.new_zeros(flat.shape).index_copy(0, rows, y.to(flat.dtype)).view_as(h), aux

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                z: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                dispatch: str = "grouped") -> tuple[torch.Tensor, MoEAux]:
        x = x + self.attn(self.attn_norm(x), cos, sin, z)
        return self.ffn(x, valid, dispatch)


class LanguageModel(nn.Module):
    """Embedding, final norm, LM head, init and loss shared by both models."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dispatch = "grouped"  # "grouped" | "split" | "loop" (reference), see moe.py
        # Set by the trainer: a training forward with labels and gradients returns no logits and
        # computes the head and its cross-entropy fused (linear_ce.py), the reference otherwise.
        self.loss_only = False
        # Sums a 1-D tensor over data-parallel processes; set by whoever parallelizes the model.
        self.stats_reduce: Reduce | None = None
        # Sums of a whole accumulated batch (``collect_stats``), set by the trainer around micro-steps.
        self.stats_totals: torch.Tensor | None = None
        self._stats_capture: list | None = None
        # Counts the routers' work over the forwards of one mode when set (``health.py``: watching a run).
        self.health: HealthTally | None = None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.vision = ImageEmbed(cfg) if cfg.image_size else None

    def _init_weights(self) -> None:
        std, depth = 0.02, (2 * self.cfg.n_layers * self.cfg.concept_loops) ** -0.5
        for name, p in self.named_parameters():
            if ".attn.w" in name and name.endswith(".bias"):  # attention biases (cfg.attn_bias) start at zero
                nn.init.zeros_(p)
                continue
            if p.dim() < 2 or ".attn.j" in name or "chunk." in name or name.startswith(("vision.", "ratio_embed.")):
                continue  # norms, zero-init joint projections, identity chunk router, patch/ratio embeddings
            scale = depth if name.endswith(("wo.weight", "w_down", "down.weight")) else 1.0
            nn.init.normal_(p, std=std * scale)
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def rope(self, n: int, device: torch.device, dtype: torch.dtype, offset: int = 0):
        pos = torch.arange(offset, offset + n, device=device)[None]
        return rope_tables(pos, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def _router_terms(self, moe_aux: list[MoEAux], chunk: ChunkStats | None = None):
        """(balance, z-loss, chunk (F, G, compression)): global over data-parallel processes
        while training when ``stats_reduce`` is set (``stats.py``), else over this batch; over a
        whole accumulated batch when the trainer has set ``stats_totals``."""
        stats = [a.stats for a in moe_aux]
        if self._stats_capture is not None:
            self._stats_capture.append(stats_vector(stats, chunk))
        if self.health is not None and self.health.counts(self):
            self.health.add_router(stats)
        if not self.training:
            return router_losses(stats, None, chunk)
        return router_losses(stats, self.stats_reduce, chunk, self.stats_totals)

    @torch.no_grad()
    def collect_stats(self, input_ids: torch.Tensor, **inputs) -> torch.Tensor:
        """The ``stats_vector`` of a forward pass over this batch (no gradients): what gradient
        accumulation sums over micro-batches before the real passes, so that the ratio, balance
        and z-losses are those of the whole batch."""
        self._stats_capture, totals = [], self.stats_totals
        self.stats_totals = None
        try:
            self.forward(input_ids, **inputs)
            return self._stats_capture[-1]
        finally:
            self._stats_capture, self.stats_totals = None, totals

    def _finish(self, x: torch.Tensor, labels: torch.Tensor | None, balance: torch.Tensor,
                z_loss: torch.Tensor, extra: dict[str, torch.Tensor], extra_loss: torch.Tensor | None) -> ModelOutput:
        h = self.norm(x)  # (B, T, D)
        aux = {"balance_loss": balance, "router_z_loss": z_loss, **extra}
        loss = logits = None
        if labels is not None and self.loss_only and self.training and torch.is_grad_enabled():
            hf = h.reshape(-1, h.shape[-1])
            ce = linear_cross_entropy(hf.to(compute_dtype(hf)), self.lm_head.weight,
                                      F.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1))
        else:
            logits = self.lm_head(h)
            if labels is not None:
                ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                     labels[:, 1:].reshape(-1), ignore_index=-100)
        if labels is not None:
            aux["ce_loss"] = ce
            loss = ce + self.cfg.balance_loss_weight * balance + self.cfg.router_z_loss_weight * z_loss
            if extra_loss is not None:
                loss = loss + extra_loss
        return ModelOutput(logits=logits, loss=loss, aux=aux)

    @staticmethod
    def _text_labels(labels: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
        """Labels with image (patch) positions ignored: the LM loss covers text only."""
        return labels if labels is None or mask is None else labels.masked_fill(mask, -100)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ``generate(...)`` is attached by ``conceptmoe.inference.generate``: model/ never imports
    # inference/ (inference drives the model, not the other way round).


class MoELM(LanguageModel):
    """Baseline: n_layers MoE blocks at token rate."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(Block(cfg, cfg.n_experts, cfg.top_k) for _ in range(cfg.n_layers))
        self._init_weights()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> ModelOutput:
        """``attention_mask`` (B, T): accepted for the trainer's batches; only the ConceptMoE's
        chunk statistics use it (causal attention keeps right padding out of real positions)."""
        x = embed_inputs(self, input_ids, pixel_values)  # (B, T, D)
        cos, sin = self.rope(x.shape[1], x.device, x.dtype)
        moe_aux = []
        for blk in self.layers:
            x, a = blk(x, cos, sin, dispatch=self.dispatch)
            moe_aux.append(a)
        balance, z_loss, _ = self._router_terms(moe_aux)
        ratio = torch.zeros((), device=x.device)
        labels = self._text_labels(labels, image_mask(self.cfg, input_ids))
        return self._finish(x, labels, balance, z_loss, {"ratio_loss": ratio, "compression": 1.0}, None)


# On CUDA the number of concepts C changes from step to step, and SDPA's cuDNN backend builds
# (and caches) an execution plan per shape: a new C costs a plan build in the forward and in the
# backward. Training pads C up to a multiple of this (exact: the padding is masked like the
# padding of shorter rows, and causal attention keeps it out of the real concepts).
CUDA_CONCEPT_BUCKET = 64


class ConceptMoELM(LanguageModel):
    """Encoder (token rate) -> chunk -> concept model (concept rate) -> dechunk -> decoder."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.encoder = nn.ModuleList(Block(cfg, cfg.n_experts, cfg.top_k)
                                     for _ in range(cfg.n_encoder_layers))
        self.chunk = ChunkRouter(cfg.d_model, cfg.chunk_router, cfg.compression_ratio, cfg.router_temperature)
        # The training-time boundary sharpness now (the trainer sets it when it is annealed,
        # chunking.sharpness_at); None: cfg.boundary_sharpness.
        self.sharpness_now: float | None = None
        self.confidence_now: float | None = None  # the trainer's scheduled confidence weight
        # C rounded up to a multiple of this in forward (None: CUDA_CONCEPT_BUCKET on CUDA, else 1)
        self.concept_bucket: int | None = None
        # Elastic models (cfg.elastic_ratios) are told each row's R (model/elastic.py).
        self.ratio_embed = RatioEmbedding(cfg.elastic_ratios, cfg.d_model, cfg.ratio_embedding,
                                          cfg.compression_ratio) if cfg.elastic_ratios else None
        self.concept = nn.ModuleList(Block(cfg, cfg.concept_experts, cfg.concept_k)
                                     for _ in range(cfg.n_concept_layers))
        first_joint = cfg.n_decoder_layers - cfg.n_joint_layers  # joint decoding in the last K layers
        self.decoder = nn.ModuleList(Block(cfg, cfg.n_experts, cfg.top_k, joint=i >= first_joint)
                                     for i in range(cfg.n_decoder_layers))
        # Stage boundaries (cfg.stage_norms, cfg.stage_skip). The skip is made after the init, at
        # zero (the identity alone at first): every other weight draws the random numbers it drew
        # before the options existed.
        self.encoder_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.stage_norms else None
        self.concept_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.stage_norms else None
        self._init_weights()
        self.skip = None
        if cfg.stage_skip:
            self.skip = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
            nn.init.zeros_(self.skip.weight)

    # The three stage boundaries, used by every path that runs the model (training, the KV-cached
    # steps, the chunked prefill, vLLM): each is the identity when its option is off.
    def encoder_out(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's output ĥ from its last block's residual stream (normed with stage_norms)."""
        return x if self.encoder_norm is None else self.encoder_norm(x)

    def concept_out(self, c: torch.Tensor) -> torch.Tensor:
        """The concept stack's output from its last block's residual stream (normed with stage_norms)."""
        return c if self.concept_norm is None else self.concept_norm(c)

    def skip_out(self, h: torch.Tensor) -> torch.Tensor:
        """What the skip around the concept stack adds to the dechunked stream: ĥ, plus W ĥ with stage_skip."""
        return h if self.skip is None else h + self.skip(h)

    def encode(self, input_ids: torch.Tensor,
               pixel_values: torch.Tensor | None = None) -> tuple[torch.Tensor, list[MoEAux]]:
        x = embed_inputs(self, input_ids, pixel_values)
        cos, sin = self.rope(x.shape[1], x.device, x.dtype)
        aux = []
        for blk in self.encoder:
            x, a = blk(x, cos, sin, dispatch=self.dispatch)
            aux.append(a)
        return self.encoder_out(x), aux

    def run_concepts(self, c: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[MoEAux]]:
        cos, sin = self.rope(c.shape[1], c.device, c.dtype)  # concept index as RoPE position
        aux, rows = [], valid_rows(mask)
        for _ in range(self.cfg.concept_loops):
            for blk in self.concept:
                c, a = blk(c, cos, sin, valid=rows, dispatch=self.dispatch)
                aux.append(a)
        return self.concept_out(c), aux

    def ratio_terms(self, ratio, batch: int, device: torch.device, extrapolate: bool = False) -> RatioTerms | None:
        """The ratio embedding of each row's R (number, or one per row; None: the design ratio);
        None for a fixed-R model, which takes only its own R. Every row's R is checked as the CLI
        checks ``--ratio`` (``check_ratio``): finite, > 1, in the trained range unless ``extrapolate``."""
        if ratio is not None:
            why = check_ratio(self.cfg, ratio_values(ratio), extrapolate, flag="ratio")
            if why:
                raise ValueError(why)
        if self.ratio_embed is None:
            return None
        return self.ratio_embed(as_ratios(self.cfg.compression_ratio if ratio is None else ratio, batch, device))

    def route(self, h: torch.Tensor, terms: RatioTerms | None, offset: int = 0) -> torch.Tensor:
        """Boundary probabilities p (B, T) of encoder states h (B, T, D), told each row's R."""
        if terms is None:
            return self.chunk(h, offset)
        return self.chunk(h if terms.router is None else h + terms.router[:, None].to(h.dtype), offset, terms.shift)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                boundaries_override: torch.Tensor | None = None,
                boundary_noise: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                ratio: float | torch.Tensor | None = None, extrapolate: bool = False) -> ModelOutput:
        """``boundary_noise``: uniforms (B, T) for the training-time boundary samples (default:
        drawn from the global RNG); the trainer passes them per global sequence, so that the
        samples do not depend on how a batch is split over processes.
        ``pixel_values`` (B, N, C, H, W): the images whose placeholders ``input_ids`` hold.
        ``attention_mask`` (B, T): 1 on real positions, 0 on right padding, which is left out of
        the ratio loss's F and G and of the compression (as in evaluation); causal attention
        already keeps padding out of the real positions.
        ``ratio``: the target R of an elastic model, one number or one per row (B,) (default: the
        design ratio); its ratio loss is then per sequence, against each row's own R. Outside the
        trained range only with ``extrapolate`` (and at most ``EXTRAPOLATE_FACTOR`` beyond it)."""
        cfg = self.cfg
        h, moe_aux = self.encode(input_ids, pixel_values)  # (B, T, D)
        terms = self.ratio_terms(ratio, h.shape[0], h.device, extrapolate)
        p = self.route(h, terms)  # (B, T)
        if boundaries_override is not None:
            b = boundaries_override.to(torch.bool).clone()
            b[:, 0] = True
        else:
            sharp = cfg.boundary_sharpness if self.sharpness_now is None else self.sharpness_now
            b = boundaries(p, self.training, cfg.boundary_noise, sharp, boundary_noise)
        bucket = self.concept_bucket or (CUDA_CONCEPT_BUCKET if h.is_cuda else 1)
        ch = gather_concepts(h, p, b, cfg.concept_pooling, pad_to=bucket)
        c_in = self.concept_input(ch.concepts, ch.mask, terms)
        c, aux_c = self.run_concepts(c_in, ch.mask)  # (B, C, D)
        if cfg.dechunk_source == "update":
            z_tok, z_res = dechunk(ch, c, c_in)
        else:  # an elastic model's concept vector conditions the concept layers; it is not carried on
            z_tok, z_res = dechunk(ch, c - (c_in - ch.concepts))
        x = self.skip_out(h) + z_res
        cos, sin = self.rope(x.shape[1], x.device, x.dtype)
        aux_d = []
        for blk in self.decoder:
            x, a = blk(x, cos, sin, z=z_tok, dispatch=self.dispatch)
            aux_d.append(a)
        real = attention_mask.bool() if attention_mask is not None else None  # (B, T)
        if self.health is not None and self.health.counts(self):
            self.health.add_chunk(p, b, real, cfg.elastic_ratios, None if terms is None else terms.ratio)
        chunk = ChunkStats(p.float().sum(), b.sum(), torch.tensor(b.numel(), device=b.device)) if real is None \
            else ChunkStats((p.float() * real).sum(), (b & real).sum(), real.sum())
        balance, z_loss, (F_, G, compression) = self._router_terms(moe_aux + aux_c + aux_d, chunk)
        R = cfg.compression_ratio
        rl = ratio_loss_fg(F_, G, R) if R > 1 else p.new_zeros(())
        if terms is not None:  # each row against its own R (mean over rows: exact per micro-batch)
            rl = per_sequence_ratio_loss(p, b, terms.ratio, real)[0]
        img = image_mask(cfg, input_ids)
        if img is not None and cfg.image_compression_ratio is not None:
            rl = self._modality_ratio_loss(p, b, img if real is None else img & real, real)
        extra = {"ratio_loss": rl, "compression": compression, "boundary_prob": G.detach(),
                 **modality_stats(img, b, real)}
        use_ratio = cfg.chunk_router != "fixed"
        router_loss = cfg.ratio_loss_weight * rl if use_ratio else None
        conf = cfg.router_confidence_weight if self.confidence_now is None else self.confidence_now
        if use_ratio and conf > 0 and p.shape[1] > 1:
            q = p[:, 1:].float()  # position 0 is a boundary by definition
            c = 4 * q * (1 - q)  # (B, T-1); over real positions only, as the ratio loss
            c = c.mean() if real is None else (c * real[:, 1:]).sum() / real[:, 1:].sum().clamp_min(1)
            router_loss = router_loss + conf * c
        out = self._finish(x, self._text_labels(labels, img), balance, z_loss, extra, router_loss)
        out.boundaries, out.chunks = b, ch
        return out


    @staticmethod
    def concept_input(concepts: torch.Tensor, mask: torch.Tensor, terms: RatioTerms | None) -> torch.Tensor:
        """The concept model's input (B, C, D): the concepts, plus the ratio's concept vector
        (``ratio_embedding="router+concept"``) on real concepts. The dechunk takes the vector off
        again (c_out - vector, or the update c_out - c_in): a signal to the concept layers only, so
        at a zero vector the model is exactly a fixed-R model."""
        if terms is None or terms.concept is None:
            return concepts
        return concepts + (terms.concept[:, None] * mask[..., None]).to(concepts.dtype)

    def _modality_ratio_loss(self, p: torch.Tensor, b: torch.Tensor, img: torch.Tensor,
                             real: torch.Tensor | None = None) -> torch.Tensor:
        """Ratio loss with target R on text and ``image_compression_ratio`` on image positions,
        weighted by each modality's share of the (real) positions (this batch's statistics)."""
        cfg, total = self.cfg, p.new_zeros(())
        text = ~img if real is None else ~img & real
        for where, R in ((text, cfg.compression_ratio), (img, cfg.image_compression_ratio)):
            share = where.float().mean() if real is None else where.float().sum() / real.sum().clamp_min(1)
            if bool(where.any()):
                total = total + share * ratio_loss(p, b, R, where)
        return total


def build_model(cfg: ModelConfig) -> LanguageModel:
    """Instantiate the model a config describes (``cfg.kind``: "moe" or "conceptmoe")."""
    return ConceptMoELM(cfg) if cfg.is_concept else MoELM(cfg)

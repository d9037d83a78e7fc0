"""ConceptMoE as a vLLM model: the encoder and decoder on vLLM's paged token KV cache, the concept
model on a paged KV cache of concepts (CONCEPTMOE.md §4; ``kv.py`` for the memory side).

vLLM hands the model one flat batch: the new tokens of every scheduled request laid end to end
(a prefill chunk, or one decode token), their absolute positions, and per-layer attention
metadata. One forward:

1. encoder blocks at token rate (vLLM ``Attention``, the token group's block tables);
2. the chunk router: p_t against W_k ĥ_{t-1}, the previous token of the same request, or for a
   chunk's first token the key its request kept from the last step (per-request state, below);
   boundaries are p >= 0.5 (the inference rule);
3. each request's new concepts (the boundary states, or the mean since the previous boundary)
   go through the concept blocks as one flat batch of concepts, positioned at their concept index;
   their attention metadata is built here from the concept group's block tables: request r's
   C_r earlier concepts are its context, its m_r new ones the queries, written at slots C_r..;
4. dechunk: the EMA over each request's concepts, concept by concept as ``inference/steps.py``,
   started from the z its request kept, broadcast back to the tokens;
5. decoder blocks at token rate with joint decoding; the final norm; ``compute_logits`` applies
   the head.

Per-request state (the router's last key, z, the mean-pooling sum and count, the concept count)
lives in tensors of the model (``state.py``) with one row per concept-group block, indexed by the request's
first concept block: the block is the request's own from its first step to its last, and a request
starting over (new, or recomputed after preemption: its first position is 0) resets its row. It
is a few vectors per request, next to the KV blocks each request holds.

The token-rate reference is ``inference/steps.py``; tests check greedy outputs against
``model.generate`` token for token. When vLLM compiles (not ``--enforce-eager``), steps 1 and 2,
3's concept blocks, and 5 are three functions compiled with inductor, dynamic in their row count,
without dynamo's per-call guards on the weights (``stages.py``). A decode step with new concepts runs
3 to 5 as one graph (``_tail``); the host's part of the step stays eager: where the concepts are
(the router's decisions, read back), the grant check, the concept-rate metadata, the report. In
other steps gathering and dechunking (a request's EMA concept by concept) run eager between the
concept graph and the decoder's. On CUDA only eager is allowed (untested).
The blocks run on vLLM's kernels (``dense.py``): fused projections, fused MoE, paged attention.

Shape legend: N tokens in the flat batch, M new concepts in it, R requests, D d_model,
H query heads, G key/value heads, Dh head dim.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import ReplicatedLinear

from ..model.attention import rope_tables
from ..model.config import ModelConfig
from ..model.lm import Block, ConceptMoELM, build_model
from .dense import BlockLinears, run_block
from .cache import ConceptCache
from .kv import ConceptAttention
from .refuse import compiles, refuse_backend, refuse_unsupported
from .ratio import repeat_terms, row_ratios
from .stages import Stages
from .state import (Batch, RequestStates, concept_inputs, dechunk, decoding, drop_requests, ema_update, host,
                    locate_concepts, on)


class _Step(NamedTuple):
    """One forward's requests and what the concept step needs of them."""

    md: dict  # vLLM's attention metadata per layer
    groups: list  # the concept groups: (layer names, block table)
    batch: Batch
    states: RequestStates
    terms: object  # an elastic model's ratio terms, one row per request (else None)
    n: int  # real tokens in the flat batch
    fed: tuple  # the concept groups' feedback keys and grants, the requests without their snapshot
    tokens: torch.Tensor  # the token group's block table (a snapshot's row: ``cache.py``)


class ConceptMoEForCausalLM(nn.Module):
    """vLLM's model class for an exported ConceptMoE (``model_type`` ``conceptmoe``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        refuse_unsupported(vllm_config)
        self.vllm_config = vllm_config
        hf = vllm_config.model_config.hf_config
        cfg = ModelConfig.from_dict(hf.conceptmoe)
        self.cfg, self.ratio = cfg, getattr(hf, "concept_ratio", None)
        self.extrapolate = bool(getattr(hf, "extrapolate", False))
        self.model = build_model(cfg)
        cache = vllm_config.cache_config
        attn = lambda cls, name, **kw: cls(cfg.n_heads, cfg.head_dim, cfg.head_dim ** -0.5,  # noqa: E731
                                          num_kv_heads=cfg.n_kv_heads, cache_config=cache,
                                          prefix=f"{prefix}.{name}", **kw)
        n_token = len(self.model.layers) if not cfg.is_concept else cfg.n_encoder_layers + cfg.n_decoder_layers
        self.token_attn = nn.ModuleList(attn(Attention, f"token_attn.{i}") for i in range(n_token))
        n_concept = cfg.n_concept_layers * cfg.concept_loops if cfg.is_concept else 0
        self.concept_attn = nn.ModuleList(attn(ConceptAttention, f"concept_attn.{i}",
                                               compression=float(self.ratio or cfg.compression_ratio))
                                          for i in range(n_concept))
        if n_concept:
            refuse_backend(self.concept_attn[0].attn_backend.get_name())
        # Each block's routed experts on vLLM's fused MoE kernels (our router and shared expert
        # stay ours): the weights are copied in at load_weights.
        blocks = self._blocks()
        self.fused = nn.ModuleList(self._fused_moe(blk.moe, f"{prefix}.fused.{i}") for i, blk in enumerate(blocks))
        # ... and their dense projections fused on vLLM's linear layers (dense.py), the head too
        self.dense = nn.ModuleList(BlockLinears(blk, f"{prefix}.dense.{i}") for i, blk in enumerate(blocks))
        self.head = ReplicatedLinear(cfg.d_model, cfg.vocab_size, bias=False, params_dtype=torch.get_default_dtype(),
                                     prefix=f"{prefix}.head", return_bias=False)
        self._layers = self._stacks()
        self._compile = compiles(vllm_config)
        self._stage = Stages(self, self._compile, dict(vllm_config.compilation_config.inductor_compile_config))
        self._cache = ConceptCache(vllm_config, self.concept_attn)
        self._released: dict[str, torch.Size] = {}  # our weights freed once copied into vLLM's layers
        # RoPE's cos and sin for every position a step can hold, computed once: inside a compiled
        # stage each one is a row read (computed there, inductor recomputed them per head and
        # element: 30 ms of a 4K-token prefill)
        rows = max(vllm_config.model_config.max_model_len, vllm_config.scheduler_config.max_num_batched_tokens)
        cos, sin = rope_tables(torch.arange(rows + 1), cfg.head_dim, cfg.rope_theta, torch.float32)
        self.register_buffer("_cos", cos, persistent=False)  # (positions, Dh)
        self.register_buffer("_sin", sin, persistent=False)

    def _blocks(self) -> list[Block]:
        m = self.model
        if not isinstance(m, ConceptMoELM):
            return list(m.layers)
        return [*m.encoder, *m.concept, *m.decoder]

    def _stacks(self) -> dict[str, list[tuple[Block, BlockLinears, Attention, nn.Module]]]:
        """Each stage's layers as (our block, its fused linears, its vLLM attention, its fused
        experts), in order (the concept blocks repeated over their loops, as their attention is)."""
        m = self.model
        own = {id(b): (lin, fused) for b, lin, fused in zip(self._blocks(), self.dense, self.fused)}
        stack = lambda blocks, attns: [(b, own[id(b)][0], a, own[id(b)][1])  # noqa: E731
                                       for b, a in zip(blocks, attns)]
        if not isinstance(m, ConceptMoELM):
            return {"plain": stack(m.layers, self.token_attn)}
        n_enc = len(m.encoder)
        return {"encoder": stack(m.encoder, self.token_attn[:n_enc]),
                "decoder": stack(m.decoder, self.token_attn[n_enc:]),
                "concept": stack([*m.concept] * self.cfg.concept_loops, self.concept_attn)}

    def _fused_moe(self, moe, prefix: str):
        from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

        return FusedMoEFactory(num_experts=moe.n_experts, top_k=moe.top_k, hidden_size=moe.w_gate.shape[1],
                               intermediate_size=moe.w_gate.shape[2], renormalize=moe.norm_topk_prob,
                               params_dtype=torch.get_default_dtype(), prefix=prefix)

    def _copy_experts(self) -> None:
        """Our (E, D, F) gate/up and (E, F, D) down into vLLM's (E, 2F, D) w13 and (E, D, F) w2."""
        for blk, fused in zip(self._blocks(), self.fused):
            params = dict(fused.named_parameters())
            w13 = next(v for k, v in params.items() if k.endswith("w13_weight"))
            w2 = next(v for k, v in params.items() if k.endswith("w2_weight"))
            with torch.no_grad():
                w13.copy_(torch.cat([blk.moe.w_gate.transpose(1, 2), blk.moe.w_up.transpose(1, 2)], 1))
                w2.copy_(blk.moe.w_down.transpose(1, 2))

    # -- vLLM's model interface ------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.head(hidden_states)

    def load_weights(self, weights) -> set[str]:
        """The export's ``model.<our key>`` tensors, into our modules (tied keys included)."""
        state = {f"model.{k}": v for k, v in self.model.state_dict(keep_vars=True).items()}
        seen = set()
        for name, w in weights:
            if name not in state:
                raise ValueError(f"unexpected weight {name!r} in a conceptmoe checkpoint")
            t = state[name]
            if name in self._released:  # loaded again: its room back first
                t.data = t.new_empty(self._released.pop(name))
            with torch.no_grad():
                t.data.copy_(w.to(t.dtype))
            seen.add(name)
        missing = sorted(set(state) - seen - {"model.lm_head.weight"} if self.cfg.tie_embeddings
                         else set(state) - seen)
        if missing:
            raise ValueError(f"conceptmoe checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
        self._copy_experts()
        with torch.no_grad():
            for blk, lin in zip(self._blocks(), self.dense):
                lin.load_from(blk)
            self.head.weight.copy_(self.model.lm_head.weight)
        self._release(state)
        return {name for name, _ in self.named_parameters()}

    def _release(self, state: dict) -> None:
        """Free our copies of what now lives in vLLM's layers (the experts, the dense projections,
        an untied head): the model holds its weights once, not twice."""
        copied = re.compile(r"\.moe\.w_(gate|up|down)$|\.attn\.[wj][qkvo]\.weight$"
                            r"|\.moe\.shared\.(gate|up|down)\.weight$")
        for name, t in state.items():
            if copied.search(name) or (name == "model.lm_head.weight" and not self.cfg.tie_embeddings):
                self._released[name] = t.shape
                t.data = t.new_empty(0)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        m = self.model
        x = m.embed(input_ids) if inputs_embeds is None else inputs_embeds  # (N, D)
        md = get_forward_context().attn_metadata
        dummy = md is None or not isinstance(md, dict)  # profile and warm-up runs: shapes only
        if dummy and self._compile and x.shape[0] > 1:
            self.forward(None if input_ids is None else input_ids[:1], positions[:1], inputs_embeds=x[:1])
        if not isinstance(m, ConceptMoELM):
            return self._stage("plain", x.shape[0])(x, positions.clone())
        step = None if dummy else self._step(md, x)
        n = x.shape[0] if step is None else step.n  # the real tokens (vLLM may pad the batch)
        # positions copied: vLLM's are a view of a buffer made outside inference mode, which dynamo
        # would trace as such (its base's size, its dispatch keys), unlike the concepts' positions
        h, pos = x[:n], positions[:n].clone()
        h, p, keys = self._stage("encoder", n)(h, *self._route_inputs(h, pos, step))
        out = self._concepts_dummy(h, p, pos) if step is None else self._concepts(h, p, keys, pos, step)
        return out if n == x.shape[0] else torch.cat([out, out.new_zeros(x.shape[0] - n, out.shape[1])])

    # -- the stages: token-rate stacks and the concept stack, compiled unless eager -------------

    def _plain(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self._rope(pos, x.dtype)
        for blk, lin, attn, fused in self._layers["plain"]:
            x = run_block(blk, lin, attn, fused, x, cos, sin)
        return self.model.norm(x)

    def _encoder(self, x: torch.Tensor, pos: torch.Tensor, *route):
        """The encoder blocks, then the chunk router on their output: (h, p, keys)."""
        cos, sin = self._rope(pos, x.dtype)
        for blk, lin, attn, fused in self._layers["encoder"]:
            x = run_block(blk, lin, attn, fused, x, cos, sin)
        x = self.model.encoder_out(x)
        return (x, *self._route(x, pos, *route))

    def _route(self, h: torch.Tensor, pos: torch.Tensor, carry: torch.Tensor, kept: torch.Tensor,
               bias: torch.Tensor | None, shift: torch.Tensor | None):
        """p (N,) and the cosine router's keys (N, D) fp32 (else None): each token against the
        previous token's key, a request's first token (``carry``) against the key it kept."""
        chunk = self.model.chunk
        h = h if bias is None else h + bias.to(h.dtype)
        keys = prev = None
        if self.cfg.chunk_router == "cosine":
            keys = chunk.key(h)
            prev = torch.where(carry[:, None], kept, torch.roll(keys, 1, 0))
        p, _ = chunk.step(h, prev, pos, **({} if shift is None else {"shift": shift}))
        return p, keys

    def _decoder(self, x: torch.Tensor, z: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self._rope(pos, x.dtype)
        h = self.model.skip_out(x) + z
        for blk, lin, attn, fused in self._layers["decoder"]:
            h = run_block(blk, lin, attn, fused, h, cos, sin, z)
        return self.model.norm(h)

    def _tail(self, h: torch.Tensor, p: torch.Tensor, pos: torch.Tensor, at: torch.Tensor, c_pos: torch.Tensor,
              z: torch.Tensor, c_terms: torch.Tensor | None):
        """A decode step after the router, as one graph: the concepts the tokens ``at`` (M,) close
        (a request's one token closes one at most) through the concept stack at ``c_pos``, each
        request's z (N, D) stepped where it has a new concept, the decoder. The eager step's
        operations (``_concepts``: in fp32 the same bits, in bf16 rounded as inductor rounds a fused
        kernel). Returns the decoder's output and the new z (N, D)."""
        src = self._source(h[at], c_pos, c_terms, self._concept)
        z = z.index_put((at,), ema_update(p[at], src, z[at]))
        return self._decoder(h, z, pos), z

    def _source(self, c_raw: torch.Tensor, c_pos: torch.Tensor, c_terms: torch.Tensor | None, concept) -> torch.Tensor:
        """What dechunking reads of the new concepts c_raw (M, D): the concept stack's output
        (``concept``: its graph, or the method inside one) less its input, or less the ratio terms."""
        c_in = c_raw if c_terms is None else c_raw + c_terms.to(c_raw.dtype)
        c = concept(c_in, c_pos)
        return c - c_in if self.cfg.dechunk_source == "update" else c - (c_in - c_raw)

    def _concept(self, c: torch.Tensor, c_pos: torch.Tensor) -> torch.Tensor:
        """The concept blocks (times their loops) on the flat batch of new concepts c (M, D)."""
        cos, sin = self._rope(c_pos, c.dtype)
        for blk, lin, attn, fused in self._layers["concept"]:
            c = run_block(blk, lin, attn, fused, c, cos, sin)
        return self.model.concept_out(c)

    # -- the pieces ------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin (N, Dh) of ``positions``: rows of the tables ``rope_tables`` made once."""
        pos = positions.long()
        return self._cos[pos].to(dtype), self._sin[pos].to(dtype)

    def _concepts_dummy(self, h: torch.Tensor, p: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Every token a concept, nothing kept: the largest concept batch, for vLLM's profiling.
        Compiled, the decode step's graphs are warmed too: one concept, and several but fewer than
        the rows (torch gives equal sizes one symbol, and would then recompile for unequal ones)."""
        n = h.shape[0]
        z = self._stage("concept", n)(h, pos) - h
        if self._compile:
            terms = None if self.model.ratio_embed is None else self.model.ratio_terms(None, 1, h.device,
                                                                                      self.extrapolate)
            for m in [1] + ([2] if n > 2 else []):
                c_terms = None if terms is None else repeat_terms(terms, [m]).concept
                at = torch.arange(m, device=h.device)
                self._stage("tail", n, m)(h, p, pos, at, pos[:m].clone(), z, c_terms)
        return self._stage("decoder", n)(h, z, pos)

    def _row_ratios(self, batch: Batch) -> list[float]:
        """Each request's R: its ``concept_ratio`` (``ratio.py``), else the export's R, else the design R."""
        default = float(self.ratio or self.cfg.compression_ratio)
        return [default if r is None else r for r in row_ratios(len(batch.starts))]

    def _terms(self, batch: Batch, device: torch.device):
        """An elastic model's ratio terms, one row per request (None for a fixed-R model)."""
        if self.model.ratio_embed is None:
            return None
        return self.model.ratio_terms(self._row_ratios(batch), len(batch.starts), device, self.extrapolate)

    def _step(self, md: dict, x: torch.Tensor) -> _Step:
        """This step's requests, their state (reset for a request starting over: new, or recomputed
        after preemption; a prefix hit's snapshot: ``cache.py``) and, for an elastic model, their ratio terms."""
        groups, tok = self._cache.groups(md), md[self.token_attn[0].layer_name]
        batch, states = Batch.of(tok, groups[0][1]), self._cache.states(x)
        fed = self._cache.begin(groups, batch, states)
        return _Step(md, groups, batch, states, self._terms(batch, x.device), batch.ends[-1] if batch.ends else 0,
                     fed, tok.block_table)

    def _route_inputs(self, h: torch.Tensor, pos: torch.Tensor, step: _Step | None):
        """The router's inputs besides h: positions, which tokens read their request's kept key
        (a chunk's first token, where the request goes on) and that key, the ratio terms per token.
        Without a step (warm-up), inputs of the same kinds and shapes."""
        n, dev = h.shape[0], h.device
        if step is None:
            carry = torch.zeros(n, dtype=torch.bool, device=dev)
            kept = h.new_zeros(n, h.shape[1], dtype=torch.float32)
            terms = repeat_terms(self.model.ratio_terms(None, 1, dev, self.extrapolate) if self.model.ratio_embed
                                 is not None else None, [n])
        else:
            b = step.batch
            going, first = np.asarray(b.done) > 0, np.asarray(b.starts, dtype=np.int64)
            carry_np, at = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)
            carry_np[first], at[first] = going, b.rows  # a chunk's first token, where its request goes on
            carry, kept = on(carry_np, dev), step.states.last_key[on(at, dev)]
            terms = repeat_terms(step.terms, [e - s for s, e in zip(b.starts, b.ends)])
        return pos, carry, kept, *((None, None) if terms is None else (terms.router, terms.shift))

    def _concepts(self, h: torch.Tensor, p: torch.Tensor, keys: torch.Tensor | None, pos: torch.Tensor,
                  step: _Step) -> torch.Tensor:
        """The boundaries, the new concepts through the concept stack, dechunked, then the decoder:
        the step's output (N, D). Compiled, a decode step with concepts to write is one graph from
        the concepts to the decoder (``_tail``); other steps run the concept stack and the decoder
        as two graphs, gathering and dechunking eager between them."""
        cfg, md, groups, batch, states = self.cfg, step.md, step.groups, step.batch, step.states
        dev, n = h.device, h.shape[0]
        bn = host(p if p.dtype == torch.float32 else p.float()) >= 0.5  # the boundaries
        fed, grants, broken = step.fed  # feedback keys, grants, requests without their snapshot
        at, cpos, counts, firsts = locate_concepts(bn, batch, states)
        flags = self._cache.admit(grants, firsts, counts, broken)  # requests whose concepts pass their blocks
        z_tok = pool0 = None  # the state inside the step, for the prefix cache's snapshots
        rows = np.asarray(batch.rows, dtype=np.int64)
        rows_t, decode = on(rows, dev), decoding(batch)
        if self._compile and decode and at.size and not flags.any() and cfg.concept_pooling != "mean":
            c_pos = on(cpos, dev)
            c_terms = None if step.terms is None else repeat_terms(step.terms, counts).concept
            self._cache.install_metadata(md, groups, counts, firsts, c_pos)
            out, z = self._stage("tail", n, at.size)(h, p, pos, on(at, dev), c_pos, states.z[rows_t], c_terms)
            states.z[rows_t] = z
            states.concepts.numpy()[rows] += bn
        else:
            b, mean = on(bn, dev), cfg.concept_pooling == "mean"
            if mean and self._cache.lead and not decode:  # a prefill's inner block ends need the pool it began with
                pool0 = (states.pool_sum[rows_t].clone(), states.pool_count[rows_t].clone())
            c_raw, c_pos, c_p = concept_inputs(h, b, p, at, cpos, batch, states, mean)
            counts, firsts = counts.tolist(), firsts.tolist()
            if flags.any():  # their concepts dropped: nothing written; the scheduler recomputes or ends them
                c_raw, c_pos, c_p, counts, b = drop_requests(flags.nonzero()[0].tolist(), c_raw, c_pos, c_p,
                                                             counts, b, batch)
            if c_raw.shape[0]:
                c_terms = None if step.terms is None else repeat_terms(step.terms, counts).concept
                self._cache.install_metadata(md, groups, counts, firsts, c_pos)
                src = self._source(c_raw, c_pos, c_terms, self._stage("concept", c_raw.shape[0]))  # (M, D)
            else:
                src = h.new_zeros(0, h.shape[1])
            z_tok = dechunk(src, c_p, b, batch, counts, states)
            out = self._stage("decoder", n)(h, z_tok, pos)
        if keys is not None:  # each request's last key (a decode step: every token is one)
            states.last_key[rows_t] = keys if decode else keys[on(np.asarray(batch.ends, dtype=np.int64) - 1, dev)]
        self._cache.report(fed, grants, batch, states, flags)
        self._cache.save(batch, bn, flags, grants, firsts, keys, z_tok, h, pool0, states, step.tokens)
        return out

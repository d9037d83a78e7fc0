"""ConceptMoE (and our MoE) as a transformers model: ``AutoModelForCausalLM`` + ``generate()`` (issue 11 A).

- ``ConceptMoEConfig``: a ``PreTrainedConfig`` (``model_type="conceptmoe"``) holding our
  ``ModelConfig`` as a dict (``conceptmoe``); the usual fields (``vocab_size``, ``hidden_size``,
  ...) are derived from it, so a field added to ``ModelConfig`` flows through unchanged.
- ``ConceptMoEForCausalLM``: ``PreTrainedModel`` + ``GenerationMixin`` around our own model
  (``build_model``, attribute ``model``). It calls the package's forward pass, ``prefill`` and
  ``decode_step`` (CONCEPTMOE.md §2, §4): nothing of the method is re-implemented here.
- The cache is ``ConceptMoECache`` (``hf_cache.py``): ragged token and concept K/V, the router's
  last key, the EMA state. ``forward`` takes it as ``cache`` (transformers 5's name;
  ``past_key_values`` is the deprecated alias) and returns it as ``output.cache``.

Padding: each row's real tokens must be contiguous (left padding, as ``generate`` uses, or right
padding). Rows are moved to the left edge internally (``inference.generate.compact``), so padding
tokens never reach the model and may carry any id; logits come back in the caller's layout
(zeros at padding positions). With a cache and ``logits_to_keep=1`` (what ``generate`` passes)
the prefill's own last-token logits are returned, so greedy ``generate`` equals our
``model.generate(temperature=0)`` token for token. Otherwise logits come from the full forward
pass (and, with a cache, the prefill runs as well to build it).

``register()`` makes ``AutoConfig`` / ``AutoModelForCausalLM`` know ``"conceptmoe"`` in this
process: it runs when this module is imported, and ``conceptmoe/interop/hf_register.py`` imports
this module as soon as transformers is imported after ``import conceptmoe``.

Shape legend: B batch, T input columns, n new tokens, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg

from ..inference.generate import compact
from ..inference.steps import decode_step, prefill
from ..model.config import ModelConfig
from ..model.elastic import check_ratio, ratio_values
from ..model.lm import build_model
from .hf_cache import ConceptMoECache
from .hf_remote_code import AUTO_MAP, write_remote_code

MODEL_TYPE = "conceptmoe"
# transformers >= 5.20 names the returned cache ``cache``; earlier 5.x (the range vLLM 0.32 pins)
# ``past_key_values``, which generate() then reads. Return it under whichever name this one has.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class ConceptMoEConfig(PreTrainedConfig):
    """transformers config of a conceptmoe model: ``conceptmoe`` is ``ModelConfig.to_dict()``."""

    model_type = MODEL_TYPE
    conceptmoe: dict | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # The token before a document (training/conventions.py): BOS, else EOS, else (runs without
    # special tokens) the last token of the document separator, for ``--model_args prefix_token_id=``.
    prefix_token_id: int | None = None
    max_position_embeddings: int | None = None  # the run's maximum length (lm-evaluation-harness reads it)
    # The compression R an elastic ConceptMoE runs at (None: its design ratio); ``generate(...,
    # concept_ratio=R)`` overrides it per call, ``--model_args concept_ratio=R`` per harness run.
    concept_ratio: float | None = None
    # Whether concept_ratio (here or per call) may lie outside the trained range (capped:
    # ``model/elastic.py``'s check_ratio, the one check of --ratio and every other entry point).
    extrapolate: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        cfg = self.model_config()
        self.check_concept_ratio(cfg)
        self.conceptmoe = cfg.to_dict()
        self.vocab_size, self.hidden_size, self.num_hidden_layers = cfg.vocab_size, cfg.d_model, cfg.n_layers
        self.num_attention_heads, self.num_key_value_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim, self.tie_word_embeddings = cfg.head_dim, cfg.tie_embeddings
        super().__post_init__(**kwargs)

    def check_concept_ratio(self, cfg: ModelConfig) -> None:
        """Refuse a default ``concept_ratio`` the model cannot serve (checked again when the model is
        built: ``from_pretrained(..., concept_ratio=R)`` sets it after the config is made)."""
        if self.concept_ratio is not None:
            why = check_ratio(cfg, [self.concept_ratio], bool(self.extrapolate), flag="concept_ratio")
            if why:
                raise ValueError(why)

    def model_config(self) -> ModelConfig:
        """Our ``ModelConfig`` (the default one when the config was built without it)."""
        return ModelConfig() if self.conceptmoe is None else ModelConfig.from_dict(dict(self.conceptmoe))


class ConceptMoEForCausalLM(PreTrainedModel, GenerationMixin):
    """A conceptmoe ``MoELM`` / ``ConceptMoELM`` behind the transformers API."""

    config_class = ConceptMoEConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]  # noqa: RUF012 (transformers class attributes)
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}  # noqa: RUF012 (used only when tied)
    _is_stateful = True  # the concept state cannot be rolled back: no assisted decoding
    supports_gradient_checkpointing = False

    def __init__(self, config: ConceptMoEConfig) -> None:
        super().__init__(config)
        config.check_concept_ratio(config.model_config())
        self.model = build_model(config.model_config())
        self.post_init()

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any) -> None:
        """transformers' save, plus ``auto_map`` and the remote-code files: the folder loads anywhere."""
        if not getattr(self.config, "auto_map", None):
            self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)
        write_remote_code(save_directory)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward builds a ConceptMoECache; transformers' DynamicCache cannot hold concepts

    def _init_weights(self, module: torch.nn.Module) -> None:
        pass  # build_model initialises (CONCEPTMOE.md choices); checkpoints overwrite everything

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.model.lm_head = value

    @deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: ConceptMoECache | None = None, use_cache: bool | None = None,
                labels: torch.LongTensor | None = None, logits_to_keep: int = 0,
                inputs_embeds: torch.Tensor | None = None, return_dict: bool | None = None,
                concept_ratio: float | torch.Tensor | None = None, extrapolate: bool | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits (B, T or logits_to_keep, V); ``cache`` continues a sequence one or more tokens on.

        ``concept_ratio``: an elastic ConceptMoE's R, one number or one per row (default:
        ``config.concept_ratio``, else the design ratio); a cache keeps the R it was built with.
        Outside the trained range only with ``extrapolate`` (default: ``config.extrapolate``).

        ``position_ids`` and other keyword arguments transformers passes are ignored: positions
        follow from ``attention_mask`` (each row's first real token is position 0).
        """
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("ConceptMoEForCausalLM takes input_ids (inputs_embeds are not supported)")
        if cache is not None and not isinstance(cache, ConceptMoECache):
            raise TypeError(f"cache must be a ConceptMoECache, got {type(cache).__name__}")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if attention_mask is None and bool((input_ids >= self.model.cfg.vocab_size).any()):
            # only an added <|pad|> (runs without a pad token) lies outside the vocabulary
            attention_mask = (input_ids < self.model.cfg.vocab_size).long()
        if cache is not None and cache.state is not None:
            logits = self._forward_cached(input_ids, attention_mask, cache)
        else:
            cache = (cache or ConceptMoECache()) if use_cache else None
            ratio = self.config.concept_ratio if concept_ratio is None else concept_ratio
            extrapolate = bool(self.config.extrapolate if extrapolate is None else extrapolate)
            if ratio is not None:  # named as the caller named it (the model would say "ratio")
                why = check_ratio(self.model.cfg, ratio_values(ratio), extrapolate, flag="concept_ratio")
                if why:
                    raise ValueError(why)
            logits = self._forward_new(input_ids, attention_mask, cache, logits_to_keep, ratio, extrapolate)
        if logits_to_keep and logits.shape[1] > logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def _forward_new(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache: ConceptMoECache | None, logits_to_keep: int, ratio=None,
                 extrapolate: bool = False) -> torch.Tensor:
        ids, lengths = compact(input_ids, attention_mask)  # (B, T) right-padded, (B,)
        last_is_real = attention_mask is None or bool(attention_mask[:, -1].bool().all())
        at = {} if ratio is None else {"ratio": ratio, "extrapolate": extrapolate}
        if cache is not None:
            out, cache.state = prefill(self.model, ids, lengths, **at)
            cache.seen = input_ids.shape[1]
            if logits_to_keep == 1 and last_is_real:
                return out.logits[:, None]  # (B, 1, V): exactly what our generate samples from
        return _uncompact(self.model(ids, **at).logits, attention_mask)  # model logits: (B, T, V), compact layout

    def _forward_cached(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                cache: ConceptMoECache) -> torch.Tensor:
        n = input_ids.shape[1]
        if attention_mask is not None and not bool(attention_mask[:, -n:].bool().all()):
            raise ValueError("ConceptMoEForCausalLM: tokens fed after the prompt must all be real "
                             "(attention_mask 1); padding inside a cached sequence is not supported")
        if input_ids.shape[0] != cache.state.batch:
            raise ValueError(f"cache holds {cache.state.batch} rows, input_ids has {input_ids.shape[0]}")
        steps = [decode_step(self.model, cache.state, input_ids[:, i]).logits for i in range(n)]
        cache.seen += n
        return torch.stack(steps, 1)  # (B, n, V)


def _uncompact(x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T, V) with each row's tokens at the left edge -> the caller's layout (zeros at padding)."""
    if attention_mask is None:
        return x
    m = attention_mask.to(x.device).bool()
    start = m.float().argmax(1)  # first real column of each row
    T = m.shape[1]
    idx = (torch.arange(T, device=x.device)[None] - start[:, None]).clamp(0, T - 1)  # (B, T)
    out = torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[-1]))
    return out * m[..., None].to(out.dtype)


def register() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` resolve ``model_type="conceptmoe"`` here."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(MODEL_TYPE, ConceptMoEConfig, exist_ok=True)
    AutoModelForCausalLM.register(ConceptMoEConfig, ConceptMoEForCausalLM, exist_ok=True)


register()  # idempotent; also done by hf_register's import hook when transformers loads first

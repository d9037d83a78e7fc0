"""Test helpers for the transformers model and the harness (issue 11): tiny runs with trained-like weights.

``concept_run`` writes a run directory like ``conceptmoe train`` does (config.json,
model.safetensors, tokenizer.json) holding a tiny ConceptMoE whose router, joint-decoding
projections and every other weight are random and independent (``method_helpers.trained_like``
plus random norms), so that a mis-wired path shows up in the logits. The tokenizer is a small
byte-level BPE trained on a held-out play, so that Shakespeare encodes into few tokens.
"""

from __future__ import annotations

import torch
from method_helpers import trained_like
from safetensors.torch import save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conceptmoe import ModelConfig, build_model
from conceptmoe.training.checkpoint import RUN_FORMAT, RUN_VERSION, write_json
from conceptmoe.data.corpus import load_corpus

VOCAB = 320


# Sizes only: everything else (biases, shared-expert gate, norm_topk_prob, decoder_sparse_step,
# mlp_only_layers, sliding-window flags, tied embeddings, rope) stays transformers' default.
SHRUNK = {"vocab_size": VOCAB, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_experts": 6, "num_experts_per_tok": 2, "max_position_embeddings": 512}
SHRUNK_ARCH = {"olmoe": {"intermediate_size": 24},
               "qwen2_moe": {"moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                             "intermediate_size": 40},
               "qwen3_moe": {"moe_intermediate_size": 24, "intermediate_size": 24, "head_dim": 16}}
HF_CLASSES = {"olmoe": ("OlmoeConfig", "OlmoeForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def shrunk_config(arch: str, vocab: int = VOCAB, **over):
    """transformers' default config of ``arch`` shrunk in sizes only (``over`` on top).

    Token ids the default places beyond the shrunk vocabulary (OLMoE's eos 50279) move to the
    end of it, so that they stay valid ids.
    """
    import transformers as tr

    cls = getattr(tr, HF_CLASSES[arch][0])
    default, ids = cls(), {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(default, name), int) and getattr(default, name) >= vocab:
            ids[name] = vocab - 1
    return cls(**{**SHRUNK, **SHRUNK_ARCH[arch], "vocab_size": vocab, **ids, **over})


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = torch.tensor(p), 1
    return ids, mask


def write_tokenizer(path, vocab: int = VOCAB) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([load_corpus().val[0].text[:20000]], trainer)
    tok.save(str(path))


def concept_run(path, seed: int = 0, kind: str = "conceptmoe", seq_len: int = 64, **over):
    """A run directory with random, independent weights; returns the model (eval mode)."""
    if kind == "conceptmoe":
        model = trained_like(seed, vocab_size=VOCAB, **over)
    else:
        torch.manual_seed(seed)
        model = build_model(ModelConfig.from_preset("tiny", kind="moe", vocab_size=VOCAB, **over))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 100)
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    path.mkdir(parents=True)
    save_model(model, str(path / "model.safetensors"))
    write_tokenizer(path / "tokenizer.json")
    cfg = model.cfg
    write_json(path / "config.json", {"format": RUN_FORMAT, "version": RUN_VERSION, "name": cfg.name,
                                      "model": cfg.to_dict(), "train": {"seq_len": seq_len}})
    return model.eval()

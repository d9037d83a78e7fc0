"""Issue 60: exact in vLLM in every configuration a run can have, not only the default one.

Each run below is served by vLLM through the plugin with the load every exactness test sends
(``vllm_load.serve_and_check``: 10 concurrent prompts prefilled in 16-token chunks, a KV budget
that preempts, a grow load, seeded sampling) and must give ``model.generate``'s greedy tokens,
token for token (fp32). Between them the runs cover every model option of a run:

- ``pooled``: mean pooling, qk-norm (per head), q/k/v biases, a gated shared expert;
- ``update``: ``dechunk_source="update"``, two concept loops, joint decoding off, the linear router,
  stage norms and the learned skip (issue 67);
- ``converted``: a Qwen2-MoE-style checkpoint with biases, imported and converted to a ConceptMoE
  (its new router and joint projections given random weights: the conversion's identity init
  would make one concept per prompt).

The elastic run at several R is in test_vllm.py. Batch invariance, on every run: 12 copies of one
prompt in one batch give one answer, and it is ``model.generate``'s. All weights random and
independent.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_helpers import need_vllm

need_vllm()

from hf_helpers import concept_run, shrunk_config  # noqa: E402
from vllm_load import SHAPE, check_cached, serve_and_check  # noqa: E402

from conceptmoe.interop import import_hf  # noqa: E402
from conceptmoe.interop.convert import convert_run  # noqa: E402

OPTIONS = {
    "pooled": dict(concept_pooling="mean", qk_norm="head", attn_bias="qkv", n_shared_experts=1,
                   shared_expert_gate=True, router_noise=1.5),  # about 2 tokens a concept
    "update": dict(dechunk_source="update", concept_loops=2, joint_decoding=False, chunk_router="linear",
                   stage_norms=True, stage_skip=True),
}


def randomize(run, match) -> None:
    """Random weights for the tensors whose names ``match`` (biases, gates, new modules): a zero or
    identity init would hide a path that is served wrong."""
    path = run / "model.safetensors"
    state = load_file(str(path))
    g = torch.Generator().manual_seed(7)
    for k, v in state.items():
        if match(k):
            scale = 0.3 if v.dim() == 1 else 1 / max(v.shape[-1], 1) ** 0.5
            state[k] = (torch.randn(v.shape, generator=g) * scale).to(v.dtype)
    save_file(state, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-configs")
    for name, over in OPTIONS.items():
        concept_run(root / name, seq_len=128, **{**SHAPE, **over})
    randomize(root / "pooled", lambda k: k.endswith("bias") or "shared_gate" in k)
    randomize(root / "update", lambda k: k.startswith(("skip.", "encoder_norm.", "concept_norm.")))
    import transformers as tr

    hf = root / "qwen2"
    cfg = shrunk_config("qwen2_moe", hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                        num_hidden_layers=4, max_position_embeddings=128)
    torch.manual_seed(3)
    model = tr.Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(std=0.3)
    model.save_pretrained(hf)
    concept_run(root / "tok", seq_len=128, **SHAPE)  # its tokenizer, for the import
    (hf / "tokenizer.json").write_bytes((root / "tok" / "tokenizer.json").read_bytes())
    import_hf(hf, root / "imported")
    convert_run(root / "imported", root / "converted", ratio=2.0, split="1+2+1")
    randomize(root / "converted", lambda k: k.startswith(("chunk.", )) or ".attn.j" in k)
    return root


@pytest.mark.parametrize("name", [*OPTIONS, "converted"])
def test_every_configuration_is_exact_in_vllm(runs, name):
    got = serve_and_check(runs, name)
    assert got["got"] == got["want"], name
    assert got["again"] == got["want"][:3], name
    assert got["grown"] == got["want_grow"], name
    assert got["preemptions"] > 0, name
    check_cached(got)
    assert got["copies"] == [got["want"][8]] * 12, name  # batch invariance
    short_alone, short_batched, long_alone, long_batched = got["seeded"]
    assert short_alone[0] == short_alone[1] == short_batched[0] == short_batched[1]
    assert long_alone[0] == long_alone[1] == long_batched[0] == long_batched[1]

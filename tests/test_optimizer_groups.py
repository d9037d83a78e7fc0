"""Optimizer groups (issue 41): the chunk router's group holds everything that moves the router's
decisions, an elastic model's ratio embedding included, so ``--chunk-lr-mult 0`` freezes them all
and none of them is weight-decayed."""

import torch
from safetensors.torch import load_file

from conceptmoe.model.config import ModelConfig
from conceptmoe.model.lm import build_model
from conceptmoe.training import checkpoint as ck
from conceptmoe.training.config import TrainConfig
from conceptmoe.training.train import make_optimizer, train
from training_helpers import TINY, make_corpus


def test_the_ratio_embedding_is_in_the_chunk_routers_group():
    model = build_model(ModelConfig.from_preset("tiny", elastic_ratios=[1.5, 2.0, 3.0],
                                                 ratio_embedding="router+concept"))
    opt = make_optimizer(model, TrainConfig(chunk_lr_mult=3.0, weight_decay=0.1))
    groups = {g["name"]: {id(p) for p in g["params"]} for g in opt.param_groups}
    tables = {id(p) for p in model.ratio_embed.parameters()}
    assert len(tables) == 3 and tables <= groups["chunk"]
    assert {id(p) for p in model.chunk.parameters()} <= groups["chunk"]
    assert not tables & (groups["decay"] | groups["no_decay"])
    chunk = next(g for g in opt.param_groups if g["name"] == "chunk")
    assert chunk["weight_decay"] == 0.0 and chunk["lr_mult"] == 3.0


def test_chunk_lr_mult_zero_freezes_the_router_of_an_elastic_run(tmp_path):
    corpus = make_corpus(tmp_path / "c", n_docs=3, chars=3000)
    tc = TrainConfig(**TINY, data=str(corpus), out=str(tmp_path / "run"), max_steps=3, ratios="1.5,2,3",
                     chunk_lr_mult=0.0, eval_every=0, val_tokens=200, seed=3, dtype="fp32")
    out = train(tc)
    torch.manual_seed(tc.seed)  # as train() builds it
    start = build_model(ck.model_config_of(ck.read_run_config(out))).state_dict()
    end = load_file(next((out / "checkpoints").iterdir()) / "model.safetensors")  # before calibration moves the shifts
    frozen = [k for k in end if k.startswith(("chunk.", "ratio_embed."))]
    assert any(k.startswith("ratio_embed.") for k in frozen)
    for k in frozen:
        assert torch.equal(end[k], start[k]), k
    assert any(not torch.equal(end[k], start[k]) for k in end if k.startswith("encoder."))


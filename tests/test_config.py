import json

import pytest

from conceptmoe import ModelConfig
from conceptmoe.model.config import PRESETS, parse_overrides


@pytest.mark.parametrize("field,value", [
    ("compression_ratio", 1.0),
    ("compression_ratio", 0.5),
    ("top_k", 99),
    ("d_model", 30),  # not divisible by 4 heads
    ("n_kv_heads", 3),
    ("kind", "dense"),
    ("chunk_router", "random"),
    ("concept_pooling", "max"),
    ("qk_norm", "yes"),
    ("n_layers", 2),  # nothing left for the concept model
    ("concept_top_k", 9),  # > 8 experts
    ("ratio_loss_weight", -1.0),
    ("n_experts", 0),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field if field != "n_layers" else "n_layers"):
        ModelConfig.from_preset("tiny", **{field: value})


def test_moe_ignores_concept_fields():
    cfg = ModelConfig.from_preset("tiny", kind="moe", compression_ratio=1.0)
    assert cfg.n_concept_layers == cfg.n_layers


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_json_round_trip(name, tmp_path):
    cfg = ModelConfig.from_preset(name, concept_top_k=3)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    cfg.to_json(tmp_path / "c.json")
    assert ModelConfig.from_json(tmp_path / "c.json") == cfg
    assert ModelConfig.from_dict(json.loads(cfg.to_json())).to_dict() == cfg.to_dict()


def test_unknown_field_rejected():
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({"kind": "moe", "nonsense": 1})


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.from_preset("huge")


def test_parse_overrides_types():
    o = parse_overrides(["top_k=3", "compression_ratio=1.5", "joint_decoding=false",
                         "chunk_router=linear", "concept_top_k=none"])
    assert o == {"top_k": 3, "compression_ratio": 1.5, "joint_decoding": False,
                 "chunk_router": "linear", "concept_top_k": None}
    with pytest.raises(ValueError, match="top_k"):
        parse_overrides(["top_k=many"])
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["top_k"])


def test_paper_style_name():
    cfg = ModelConfig.from_preset("small", concept_top_k=12, compression_ratio=1.5)
    assert cfg.name == "ConceptMoE-1L-top12-R1.5"
    assert ModelConfig.from_preset("small", kind="moe").name == "MoE-top4"

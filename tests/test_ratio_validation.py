"""One check of a ratio for every entry point (issue 41): the trained set (``--ratios``, ``--set
elastic_ratios``, stored configs) and an asked-for R (``--ratio``, ``model(ids, ratio=)``,
``generate(ratio=)``, the transformers model's ``concept_ratio``): refused with one line, never
NaN, outside the trained range only when asked and at most ``EXTRAPOLATE_FACTOR`` beyond it."""

import math

import pytest
import torch

from conceptmoe.errors import UserError
from conceptmoe.model.config import ModelConfig, parse_overrides
from conceptmoe.model.elastic import EXTRAPOLATE_FACTOR, check_ratio
from conceptmoe.training.config import TrainConfig, model_config
from test_elastic import RATIOS, _model
from training_helpers import run_cli

IDS = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("ratios", ["2,2.0000000001", "2,2", "1.5,64.5", "nan,2"])
def test_ratios_flag_refuses_what_cannot_train(ratios):
    with pytest.raises(UserError, match="^--ratios: "):
        TrainConfig(preset="tiny", ratios=ratios)


@pytest.mark.parametrize("raw, match", [("3,2", "must increase"), ("2,2.0000000001", "too close")])
def test_set_elastic_ratios_is_checked_like_ratios(raw, match):
    tc = TrainConfig(preset="tiny", overrides=parse_overrides([f"elastic_ratios={raw}"]))
    with pytest.raises(UserError, match=f"^--ratios \\(or --set elastic_ratios\\): .*{match}"):
        model_config(tc)


def test_ratios_and_set_elastic_ratios_conflict():
    with pytest.raises(UserError, match="give one of them"):
        TrainConfig(preset="tiny", ratios="2,3", overrides={"elastic_ratios": [2.0, 4.0]})


def test_plain_moe_refuses_elastic_ratios(tmp_path):
    with pytest.raises(ValueError, match="elastic_ratios"):
        ModelConfig(kind="moe", elastic_ratios=[2.0, 3.0])
    out = tmp_path / "run"
    res = run_cli("train", "--model", "moe", "--preset", "tiny", "--set", "elastic_ratios=2,3",
                  "--max-steps", "1", "--out", str(out), "--device", "cpu")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("error: --ratios (or --set elastic_ratios): ") and not out.exists()


def test_extrapolation_is_capped():
    cfg = ModelConfig.from_preset("tiny", elastic_ratios=RATIOS)
    lo, hi = min(RATIOS), max(RATIOS)
    assert check_ratio(cfg, [hi * 1.5]) and check_ratio(cfg, [hi * 1.5], extrapolate=True) is None
    assert check_ratio(cfg, [hi * EXTRAPOLATE_FACTOR], extrapolate=True) is None
    for r in (hi * EXTRAPOLATE_FACTOR * 1.01, 1e300, 1.0, 0.5, -2.0, math.nan, math.inf):
        assert check_ratio(cfg, [r], extrapolate=True), r
    assert lo / EXTRAPOLATE_FACTOR < 1.2 and check_ratio(cfg, [1.2], extrapolate=True) is None


@pytest.mark.parametrize("bad", [6.0, 100.0, -2.0, math.nan, math.inf, 1.0])
def test_model_refuses_what_the_cli_refuses(bad):
    m = _model().eval()
    with pytest.raises(ValueError, match="^ratio: "):
        m(IDS, ratio=bad)
    with pytest.raises(ValueError, match="^ratio: "):
        m.generate(IDS, 2, temperature=0, ratio=bad)


def test_one_bad_row_is_refused_and_extrapolation_only_when_asked():
    m = _model().eval()
    with pytest.raises(ValueError, match="got nan"):
        m(IDS, ratio=torch.tensor([2.0, math.nan, 3.0]))
    with pytest.raises(ValueError, match="extrapolate=True"):
        m(IDS, ratio=torch.tensor([2.0, 6.0, 3.0]))
    out = m(IDS, ratio=torch.tensor([2.0, 6.0, 3.0]), extrapolate=True)
    assert torch.isfinite(out.logits).all()
    with pytest.raises(ValueError, match="too far"):
        m(IDS, ratio=1e300, extrapolate=True)
    gen = m.generate(IDS, 3, temperature=0, ratio=6.0, extrapolate=True)
    assert torch.equal(gen, m.generate(IDS, 3, temperature=0, ratio=6.0, extrapolate=True, use_cache=False))


def test_transformers_model_checks_concept_ratio(tmp_path):
    pytest.importorskip("transformers")
    from conceptmoe.interop.hf_model import ConceptMoEConfig, ConceptMoEForCausalLM

    m = _model().eval()
    cfg = m.cfg.to_dict()
    for bad in (6.0, -2.0, math.nan):
        with pytest.raises(ValueError, match="^concept_ratio: "):
            ConceptMoEConfig(conceptmoe=cfg, concept_ratio=bad)
    hf = ConceptMoEForCausalLM(ConceptMoEConfig(conceptmoe=cfg)).eval()
    hf.model.load_state_dict(m.state_dict())
    for bad in (6.0, math.nan, torch.tensor([2.0, math.nan, 3.0])):
        with pytest.raises(ValueError, match="^concept_ratio: "):
            hf(IDS, concept_ratio=bad)
        with pytest.raises(ValueError, match="^concept_ratio: "):
            hf.generate(IDS, max_new_tokens=2, do_sample=False, concept_ratio=bad, pad_token_id=0)
    got = hf(IDS, concept_ratio=6.0, extrapolate=True, use_cache=False).logits
    assert torch.allclose(got, m(IDS, ratio=6.0, extrapolate=True).logits, atol=1e-5)
    hf.save_pretrained(tmp_path / "x")
    with pytest.raises(ValueError, match="^concept_ratio: "):
        ConceptMoEForCausalLM.from_pretrained(tmp_path / "x", concept_ratio=6.0)
    loaded = ConceptMoEForCausalLM.from_pretrained(tmp_path / "x", concept_ratio=6.0, extrapolate=True).eval()
    assert torch.allclose(loaded(IDS, use_cache=False).logits, got, atol=1e-5)

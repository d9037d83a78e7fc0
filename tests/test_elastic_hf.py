"""An elastic ConceptMoE behind transformers (issue 21): ``generate(..., concept_ratio=R)`` and the
config default ``concept_ratio`` (also set through ``from_pretrained(..., concept_ratio=R)``, which
is what ``--model_args concept_ratio=R`` does in lm-evaluation-harness)."""

import pytest
import torch

pytest.importorskip("transformers")

from conceptmoe.interop.hf_model import ConceptMoEConfig, ConceptMoEForCausalLM  # noqa: E402
from test_elastic import _model  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    m = _model("router+concept", seed=1).eval()
    hf = ConceptMoEForCausalLM(ConceptMoEConfig(conceptmoe=m.cfg.to_dict())).eval()
    hf.model.load_state_dict(m.state_dict())
    return m, hf


IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))


def test_generate_takes_concept_ratio(pair):
    m, hf = pair
    outs = {}
    for r in (2.5, 4.0):
        outs[r] = hf.generate(IDS, max_new_tokens=12, do_sample=False, concept_ratio=r, pad_token_id=0)
        assert torch.equal(outs[r], m.generate(IDS, 12, temperature=0, ratio=r))
    logits = {r: hf(IDS, concept_ratio=r, use_cache=False).logits for r in (2.5, 4.0)}
    assert not torch.allclose(logits[2.5], logits[4.0], atol=1e-5)  # the ratio reaches the model
    assert torch.allclose(logits[4.0], m(IDS, ratio=4.0).logits, atol=1e-5)


def test_concept_ratio_config_default_survives_save_and_load(pair, tmp_path):
    m, hf = pair
    hf.save_pretrained(tmp_path / "export")
    loaded = ConceptMoEForCausalLM.from_pretrained(tmp_path / "export", concept_ratio=4.0).eval()
    assert loaded.config.concept_ratio == 4.0
    got = loaded.generate(IDS, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, m.generate(IDS, 12, temperature=0, ratio=4.0))
    plain = ConceptMoEForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert plain.config.concept_ratio is None
    assert torch.equal(plain.generate(IDS, max_new_tokens=12, do_sample=False, pad_token_id=0),
                       m.generate(IDS, 12, temperature=0))  # the design ratio

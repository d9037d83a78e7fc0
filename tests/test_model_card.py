"""``export-hf`` writes a model card (README.md, Hugging Face format) from what the run records."""

from __future__ import annotations

import json

from hf_helpers import concept_run

from conceptmoe.cli import main


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    head = text.split("---\n")[1]
    return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in head.splitlines() if ":" in ln)}


def test_export_writes_a_model_card_from_the_run(tmp_path):
    run = tmp_path / "cm"
    concept_run(run, seed=0, seq_len=64)
    (run / "eval.json").write_text(json.dumps({"val_bpb": 1.2345, "val_loss": 2.5, "compression": 2.07,
                                               "tokens": 1000, "step": 10}))
    assert main(["export-hf", str(run), "--out", str(tmp_path / "hf")]) == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "transformers"
    assert "- conceptmoe" in card and "trust_remote_code=True" in card
    assert "Held-out bits per byte: 1.2345" in card and "2.07 tokens per concept (target 2)" in card
    assert "No compute-matched MoE is recorded" in card and "## Limitations" in card  # vocabulary not the preset's


def test_model_card_states_the_compute_match_of_a_preset_model(tmp_path):
    from conceptmoe import ModelConfig
    from conceptmoe.interop.model_card import model_card

    card = model_card(tmp_path, {"train": {"seq_len": 256, "max_steps": 10, "batch_size": 8}},
                      ModelConfig.from_preset("tiny"))
    line = next(ln for ln in card.splitlines() if "Compute match against" in ln)
    assert "activated FLOPs -9.62%, total parameters +4.80%" in line  # the un-matched tiny preset
    assert "20,480 tokens (10 steps of 8 x 256)" in card


def test_model_card_of_a_moe_export_and_of_a_run_without_evaluation(tmp_path):
    run = tmp_path / "moe"
    concept_run(run, seed=1, kind="moe", seq_len=64)
    assert main(["export-hf", str(run), "--out", str(tmp_path / "hf")]) == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    assert _front_matter(card)["license"] == "apache-2.0" and "- moe" in card
    assert "trust_remote_code" not in card and "No held-out evaluation is recorded" in card

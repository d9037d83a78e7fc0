"""--experts-multiple-of (issue 41): a --strategy run is matched with a concept-expert count that
expert parallelism can shard (default: the --expert-parallel degree), recorded in the run so that
a resume in another layout rebuilds the same model."""

import pytest

from conceptmoe.cli import build_parser, main
from conceptmoe.cli.training import train_config_from_args
from conceptmoe.training.config import TrainConfig, model_config


def _parse(*argv):
    return train_config_from_args(build_parser().parse_args(["train", *argv]))


def test_the_expert_parallel_degree_is_the_default_constraint():
    assert model_config(TrainConfig(preset="small", strategy="topk")).concept_experts == 29
    for s in (2, 4):
        tc = TrainConfig(preset="small", strategy="topk", expert_parallel=s)
        assert tc.experts_multiple_of == s and model_config(tc).concept_experts % s == 0
        assert tc.to_dict()["experts_multiple_of"] == s
    tc = _parse("--preset", "tiny", "--experts-multiple-of", "2")
    assert tc.experts_multiple_of == 2 and model_config(tc).concept_experts == 6
    assert "experts_multiple_of" not in TrainConfig(preset="small", strategy="topk").to_dict()  # as before


@pytest.mark.parametrize("argv, words", [
    (["--model", "moe", "--experts-multiple-of", "2"], "--experts-multiple-of constrains"),
    (["--strategy", "none", "--experts-multiple-of", "2"], "--experts-multiple-of constrains"),
    (["--experts-multiple-of", "0"], "--experts-multiple-of must be a positive integer"),
    (["--preset", "tiny", "--experts-multiple-of", "8"], "multiple of 8 concept experts"),
])
def test_bad_constraints_are_refused_in_one_line(capsys, tmp_path, argv, words):
    assert main(["train", "--out", str(tmp_path / "run"), "--max-steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "run").exists()


def test_compare_matches_every_conceptmoe_under_the_constraint():
    from conceptmoe.evaluation.compare import CompareConfig, plan

    cc = CompareConfig(preset="small", strategies=["topk", "layers", "loop"], ratios=[1.5, 2.0],
                       ablations=True, experts_multiple_of=4,
                       variants={"v": {"strategy": "topk", "ratio": 2.0, "set": {"ratio_loss_weight": 0.1}}})
    models = dict(plan(cc))
    assert model_config(models.pop("moe")).n_experts == 32
    for label, tc in models.items():
        assert model_config(tc).concept_experts % 4 == 0, label
    assert cc.to_dict()["experts_multiple_of"] == 4
    assert "experts_multiple_of" not in CompareConfig(preset="small").to_dict()  # as recorded before the flag
    args = build_parser().parse_args(["compare", "--experts-multiple-of", "2"])
    assert args.experts_multiple_of == 2


def test_convert_checks_the_sources_expert_count(tmp_path, capsys):
    from test_convert import moe_run

    src = moe_run(tmp_path / "moe", n_experts=6)
    assert main(["convert", str(src), "--out", str(tmp_path / "cm"), "--experts-multiple-of", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--experts-multiple-of 4" in err[0] and "6 experts" in err[0], err
    assert not (tmp_path / "cm").exists()
    assert main(["convert", str(src), "--out", str(tmp_path / "cm"), "--experts-multiple-of", "3"]) == 0


def test_a_resume_keeps_the_constraint_the_run_was_matched_under(tmp_path):
    import json

    from conceptmoe.training.config import resolve_train_config

    for trained, launch, want in ((2, 1, 2), (1, 2, 1), (4, 2, 4)):
        out = tmp_path / f"run{trained}{launch}"
        out.mkdir()
        tc = TrainConfig(preset="small", strategy="topk", experts_multiple_of=trained, out=str(out))
        (out / "config.json").write_text(json.dumps({"format": "conceptmoe-run", "train": tc.to_dict(),
                                                   "model": model_config(tc).to_dict()}))
        again = resolve_train_config({"out": str(out), "expert_parallel": launch}, resume=True)
        assert again.experts_multiple_of == want and model_config(again) == model_config(tc)


def test_train_says_what_the_constraint_cost(tmp_path, capsys):
    from training_helpers import make_corpus

    corpus = make_corpus(tmp_path / "c", n_docs=2, chars=2000)
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(tmp_path / "run"), "--max-steps",
                 "1", "--batch-size", "2", "--seq-len", "32", "--device", "cpu", "--dtype", "fp32", "--eval-every",
                 "0", "--val-tokens", "100", "--experts-multiple-of", "2"]) == 0
    err = capsys.readouterr().err
    assert ("compute match: 6 concept experts, a multiple of 2 (--experts-multiple-of): matching error 2.55% "
            "(unconstrained 1.84%)") in err, err

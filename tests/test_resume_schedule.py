"""A resumed run keeps its schedule (issue 41): the total its lr cosine, boundary-sharpness anneal
and confidence-term start are laid out over (recorded in each checkpoint) and its optimizer
settings. Another --max-steps/--tokens, a total already passed, or another --lr is refused in one
line that says what would change, and the run is left as it was."""

import json

import pytest

from conceptmoe.cli import main
from conceptmoe.training import checkpoint as ck
from training_helpers import make_corpus


def _train(corpus, out, *extra):
    return ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--batch-size", "4",
            "--seq-len", "32", "--device", "cpu", "--dtype", "fp32", "--eval-every", "0", "--val-tokens", "200",
            "--save-every", "2", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    corpus = make_corpus(root / "c", n_docs=3, chars=3000)
    out = root / "run"
    assert main(_train(corpus, out, "--max-steps", "2", "--set", "router_confidence_weight=0.1",
                       "--set", "router_confidence_start=0.5")) == 0
    # as if a 4-step run had been killed after its step-2 checkpoint: mid-run
    cfg = ck.read_run_config(out)
    cfg["train"]["max_steps"] = 4
    ck.write_json(out / "config.json", cfg)
    state = ck.latest_checkpoint(out) / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "total_steps": 4}))
    (out / "eval.json").unlink()
    return corpus, out


def _digest(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def _refused(capsys, argv, *words):
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.parametrize("extra, words", [
    (["--max-steps", "2"], ["--max-steps 2", "already at step 2", "nothing would be trained"]),
    (["--max-steps", "1"], ["--max-steps 1", "already at step 2", "nothing would be trained"]),
    (["--max-steps", "8"], ["4-step run", "--max-steps 8", "rescale", "--init"]),
    (["--max-steps", "3"], ["4-step run", "--max-steps 3", "rescale"]),
    (["--tokens", "100000"], ["4-step run", "--tokens 100000", "rescale"]),
    (["--lr", "5e-2"], ["--lr 0.001", "--lr 0.05", "leave out --lr"]),
    (["--max-steps", "4", "--warmup-steps", "3"], ["--warmup-steps"]),
])
def test_a_resume_that_would_change_the_schedule_is_refused(run, capsys, extra, words):
    corpus, out = run
    before = _digest(out)
    _refused(capsys, _train(corpus, out, "--resume", *extra), *words)
    assert _digest(out) == before


def test_a_resume_with_the_same_schedule_is_accepted(run, capsys):
    corpus, out = run
    assert main(_train(corpus, out, "--resume")) == 0  # the stored total and lr
    assert main(_train(corpus, out, "--resume", "--max-steps", "4", "--lr", "1e-3")) == 0  # the same, given


def test_a_finished_run_is_extended_with_its_schedule_kept(tmp_path, capsys):
    # after its end a run may go on (a larger --max-steps): the lr stays at its floor, the recorded
    # schedule stays the first one, and the extended run resumes as it now stands
    corpus = make_corpus(tmp_path / "c", n_docs=3, chars=3000)
    out = tmp_path / "run"
    assert main(_train(corpus, out, "--max-steps", "2", "--lr", "1e-3", "--warmup-steps", "1")) == 0
    assert main(_train(corpus, out, "--resume", "--max-steps", "4")) == 0
    assert "its 2-step schedule is kept at its end" in capsys.readouterr().err
    rows = ck.read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[2]["lr"] == rows[3]["lr"] == pytest.approx(1e-4)
    assert json.loads((ck.latest_checkpoint(out) / "state.json").read_text())["total_steps"] == 2
    assert main(_train(corpus, out, "--resume")) == 0  # finished at 4 as it now stands
    capsys.readouterr()
    _refused(capsys, _train(corpus, out, "--resume", "--max-steps", "3"), "nothing would be trained")

"""A resumed run keeps its schedule (issue 41): the total its lr cosine, boundary-sharpness anneal
and confidence-term start are laid out over (recorded in each checkpoint) and its optimizer
settings. Another --max-steps/--tokens, a total already passed, or another --lr is refused in one
line that says what would change, and the run is left as it was."""

import json

import pytest

from conceptmoe.cli import main
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
    assert main(_train(corpus, out, "--max-steps", "4", "--set", "router_confidence_weight=0.1",
                       "--set", "router_confidence_start=0.5")) == 0
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


def test_the_checkpoint_records_the_schedules_total(run):
    _, out = run
    states = sorted(out.glob("checkpoints/step-*/state.json"))
    assert states and all(json.loads(s.read_text())["total_steps"] == 4 for s in states)


@pytest.mark.parametrize("extra, words", [
    (["--max-steps", "2"], ["--max-steps 2", "already at step 4", "nothing would be trained"]),
    (["--max-steps", "8"], ["4-step run", "--max-steps 8", "rescale", "--init"]),
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

"""Refusals and provenance of issue 18, in one process: parallel layouts are checked before the
run directory is touched, a resumed run keeps its recorded ``init``, and a checkpoint that does
not fit the run says what differs (the word "damaged" is kept for bytes that fail to read)."""

import json

import pytest

from conceptmoe.errors import UserError
from conceptmoe.training import checkpoint as ck
from conceptmoe.training.config import TrainConfig, resolve_train_config
from conceptmoe.training.train import train
from training_helpers import TINY, make_corpus, run_cli


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=2, chars=3000)


@pytest.fixture(scope="module")
def base_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    train(TrainConfig(**TINY, data=str(corpus), out=str(out), max_steps=2, save_every=1, val_tokens=500))
    return out


def _cfg(corpus, out, **kw):
    return TrainConfig(**{**TINY, "data": str(corpus), "out": str(out), "max_steps": 2, "val_tokens": 500, **kw})


def test_expert_parallel_in_one_process_is_refused_before_writing(corpus, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(UserError, match="--expert-parallel 2 shards experts over processes: start the run with torchrun"):
        train(_cfg(corpus, out, model="moe", expert_parallel=2))
    assert not out.exists()
    res = run_cli("train", "--model", "moe", "--preset", "tiny", "--data", str(corpus), "--out", str(out),
                  "--max-steps", "1", "--device", "cpu", "--expert-parallel", "2")
    assert res.returncode != 0 and res.stderr.count("\n") == 1 and res.stderr.startswith("error: --expert-parallel")
    assert not out.exists()


def test_fsdp_with_expert_parallel_is_refused_before_writing(corpus, tmp_path):
    out = tmp_path / "run"
    res = run_cli("train", "--model", "moe", "--preset", "tiny", "--data", str(corpus), "--out", str(out),
                  "--max-steps", "1", "--device", "cpu", "--parallel", "fsdp", "--expert-parallel", "2")
    assert res.returncode != 0 and "combines with --parallel ddp, not fsdp" in res.stderr
    assert not out.exists()


def test_init_weights_that_do_not_fit_are_refused_before_writing(corpus, base_run, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(UserError, match="its weights do not fit this model"):
        train(_cfg(corpus, out, init=str(base_run), overrides={"expert_hidden": 24}))
    assert not out.exists()  # the corrected command is not refused as "already holds a run"
    train(_cfg(corpus, out, init=str(base_run), max_steps=1))
    assert ck.read_run_config(out)["train"]["init"] == str(base_run.resolve())


def test_resume_forgets_the_launch_layout(base_run):
    # --parallel / --expert-parallel are chosen per launch: any process count resumes a run
    cfg = ck.read_run_config(base_run)
    cfg["train"].update(parallel="ddp", expert_parallel=2)
    ck.write_json(base_run / "config.json", cfg)
    tc = resolve_train_config({"out": str(base_run)}, resume=True)
    assert tc.expert_parallel == 1 and tc.parallel is None


def test_resume_keeps_the_recorded_init(corpus, base_run, tmp_path):
    other = tmp_path / "other"
    train(_cfg(corpus, other, max_steps=1))
    cont = tmp_path / "cont"
    train(_cfg(corpus, cont, init=str(base_run), max_steps=4, save_every=1))
    recorded = ck.read_run_config(cont)["train"]["init"]
    assert recorded == str(base_run.resolve())
    given = {"out": str(cont), "init": str(other), "max_steps": 5, "progress": False}
    with pytest.raises(UserError, match=r"--resume: .* was started from .*run; a resumed run keeps its recorded init"):
        train(resolve_train_config(given, resume=True))
    assert ck.read_run_config(cont)["train"]["init"] == recorded  # nothing rewritten
    train(resolve_train_config({"out": str(cont), "max_steps": 5, "progress": False}, resume=True))
    assert ck.read_run_config(cont)["train"]["init"] == recorded
    # a run trained from scratch cannot take an --init on resume either
    with pytest.raises(UserError, match=r"was started from scratch \(no --init\)"):
        train(resolve_train_config({"out": str(other), "init": str(base_run), "max_steps": 2, "progress": False},
                                   resume=True))


def _resume(out):
    return resolve_train_config({"out": str(out), "max_steps": 3, "progress": False}, resume=True)


def test_a_checkpoint_with_other_optimizer_groups_says_so(corpus, tmp_path):
    out = tmp_path / "run"
    train(_cfg(corpus, out, save_every=1))
    meta_path = ck.latest_checkpoint(out) / "optimizer.json"
    meta = json.loads(meta_path.read_text())
    assert [g["name"] for g in meta["param_groups"]] == ["decay", "no_decay", "chunk"]
    old = meta["param_groups"]  # as an older DDP run wrote it: the router and embeddings decayed
    meta["param_groups"] = [{**old[0], "params": old[0]["params"] + old[2]["params"]}, old[1]]
    for g in meta["param_groups"]:
        g.pop("name")
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(UserError) as e:
        train(_resume(out))
    msg = str(e.value)
    assert "does not fit this run's optimizer" in msg and "parameter groups" in msg and "decay" in msg
    assert "damaged" not in msg and "intact" in msg


def test_unreadable_checkpoint_bytes_are_damaged(corpus, tmp_path):
    out = tmp_path / "run"
    train(_cfg(corpus, out, save_every=1))
    f = ck.latest_checkpoint(out) / "optimizer.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(UserError, match=r"checkpoint .* is damaged"):
        train(_resume(out))

"""Folders written whole (issue 19): convert, import-hf and export-hf build in a temporary sibling
and rename it into place; a signal leaves nothing half-written, a SIGKILL's leftover is removed by
the next run, --force replaces and never merges, weights get the umask's file mode."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conceptmoe import ModelConfig, build_model
from conceptmoe.cli import main
from conceptmoe.errors import UserError
from conceptmoe.files import building, file_mode, remove_stale, temp_name
from conceptmoe.interop.hf_run import save_weights
from conceptmoe.training.checkpoint import RUN_FORMAT, RUN_VERSION, write_json

def moe_run(path, seed=0, **over):
    """A tiny MoE run directory with random weights and a small byte-level tokenizer."""
    cfg = ModelConfig.from_preset("tiny", kind="moe", n_layers=4, vocab_size=300, **over)
    torch.manual_seed(seed)
    model = build_model(cfg)
    path.mkdir(parents=True)
    save_weights(cfg, model.state_dict(), path / "model.safetensors")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["to be or not to be, that is the question"] * 5, trainers.BpeTrainer(
        vocab_size=270, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    write_json(path / "config.json", {"format": RUN_FORMAT, "version": RUN_VERSION, "name": cfg.name,
                                      "model": cfg.to_dict(), "train": {}})
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    moe = moe_run(root / "moe")
    assert main(["export-hf", str(moe), "--out", str(root / "hf"), "--arch", "qwen2_moe"]) == 0
    return moe, root / "hf"


def _argv(command, sources, out):
    moe, hf = sources
    return {"convert": ["convert", str(moe), "--out", str(out), "--ratio", "2"],
            "import-hf": ["import-hf", str(hf), "--out", str(out)],
            "export-hf": ["export-hf", str(moe), "--out", str(out), "--arch", "qwen2_moe"]}[command]


def _hidden(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


CASES = [("convert", signal.SIGTERM), ("convert", signal.SIGINT), ("convert", signal.SIGKILL),
         ("import-hf", signal.SIGTERM), ("import-hf", signal.SIGKILL),
         ("export-hf", signal.SIGTERM), ("export-hf", signal.SIGKILL)]


def _start(argv, err_path):
    """Fork a child that runs the CLI with the step that copies tokenizer.json (after the weights
    are written) replaced by a pause; returns (pid, a file that reads "R" at the pause). Forked,
    not spawned: the child has the modules loaded already (a fresh interpreter imports torch)."""
    import conceptmoe.interop.convert as C
    import conceptmoe.interop.hf_run as H

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            os.close(r)
            sys.stderr = open(err_path, "w", buffering=1)  # noqa: SIM115  (closed by _exit)
            # Ctrl-C as in a foreground shell: pytest started as a background job (`... &` in a
            # script) inherits SIGINT ignored, and so would this child
            signal.signal(signal.SIGINT, signal.default_int_handler)

            def pause(*args):
                os.write(w, b"R")
                time.sleep(120)

            C._copy = H._copy = pause
            code = main(argv)
        finally:
            os._exit(code)
    os.close(w)
    return pid, os.fdopen(r, "rb")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX signals and fork")
def test_a_signal_leaves_no_half_folder_and_the_next_run_cleans_up(sources, tmp_path):
    """SIGTERM, SIGINT and SIGKILL at a known point (weights written, tokenizer not yet) during
    convert, import-hf and export-hf: no --out appears, the temporary folder is removed (SIGKILL:
    by the next run of the same kind, which then writes the folder whole)."""
    procs = []
    for i, (command, sig) in enumerate(CASES):
        parent = tmp_path / f"case{i}"
        parent.mkdir()
        procs.append((command, sig, parent, *_start(_argv(command, sources, parent / "out"), tmp_path / f"err{i}")))
    for command, sig, parent, pid, ready in procs:
        assert ready.read(1) == b"R", command
        tmp = temp_name(parent / "out", command, pid)
        assert (tmp / "model.safetensors").is_file() and not (parent / "out").exists()
        os.kill(pid, sig)
    for i, (command, sig, parent, pid, ready) in enumerate(procs):
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        ready.close()
        err = (tmp_path / f"err{i}").read_text()
        tmp = temp_name(parent / "out", command, pid)
        assert not (parent / "out").exists(), (command, sig)
        if sig == signal.SIGKILL:
            assert code == -signal.SIGKILL and tmp.is_dir()  # nothing can catch SIGKILL
            assert main(_argv(command, sources, parent / "out")) == 0  # the next run removes it
        else:
            assert code == 128 + sig, (command, sig, err)
            assert err.strip().splitlines()[-1].startswith(("interrupted:", "error: interrupted")), err
        assert _hidden(parent) == [], (command, sig)
    out = procs[2][2] / "out"  # the convert that followed a SIGKILL: a whole run
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    assert (out / "model.safetensors").stat().st_mode & 0o777 == file_mode()


def test_force_replaces_an_export_and_never_merges(tmp_path):
    pytest.importorskip("transformers")
    from hf_helpers import concept_run

    moe, cm = moe_run(tmp_path / "moe"), tmp_path / "cm"
    concept_run(cm)
    out = tmp_path / "hf"
    assert main(["export-hf", str(cm), "--out", str(out)]) == 0
    concept_files = {p.name for p in out.iterdir()}
    assert {"tokenizer_config.json", "modeling_conceptmoe.py"} <= concept_files
    assert main(["export-hf", str(moe), "--out", str(out), "--arch", "qwen2_moe"]) == 2  # needs --force
    assert {p.name for p in out.iterdir()} == concept_files
    assert main(["export-hf", str(moe), "--out", str(out), "--arch", "qwen2_moe", "--force"]) == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json", "README.md",
                                               "tokenizer_config.json"}
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_moe"
    assert _hidden(tmp_path) == []
    for p in out.iterdir():  # weights as every other file (safetensors alone would give 0600)
        assert p.stat().st_mode & 0o777 == file_mode(), p.name


def test_export_hf_refuses_a_vision_language_run(tmp_path, capsys):
    cfg = ModelConfig.from_preset("vlm", d_model=32, n_experts=4, expert_hidden=16, n_layers=3)
    for kind in ("conceptmoe", "moe"):
        run = tmp_path / kind
        run.mkdir()
        write_json(run / "config.json", {"format": RUN_FORMAT, "version": RUN_VERSION, "name": kind,
                                         "model": cfg.replace(kind=kind).to_dict(), "train": {}})
        assert main(["export-hf", str(run), "--out", str(tmp_path / f"hf-{kind}")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "vision-language" in err and err.count("\n") == 1
        assert not (tmp_path / f"hf-{kind}").exists()


def test_building_is_whole_or_absent(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), building(out, "test") as tmp:
        (tmp / "a").write_text("half")
        raise RuntimeError("failed midway")
    assert not out.exists() and _hidden(tmp_path) == []
    with building(out, "test") as tmp:
        (tmp / "a").write_text("1")
        (tmp / "config.json").write_text("{}")
    with pytest.raises(UserError, match="--force"), building(out, "test"):
        pass
    with building(out, "test", force=True, replaceable=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b"]  # replaced, not merged
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(UserError, match="not a run"), building(out, "test", force=True, replaceable=False):
        pass
    assert (out / "notes.txt").read_text() == "the user's"
    assert _hidden(tmp_path) == []


def test_stale_temporaries_of_the_same_kind_only(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is free
    for name in (f".a.tmp-convert-{dead.pid}", f".b.tmp-import-hf-{dead.pid}", f".c.tmp-convert-{os.getpid()}",
                 f".d.tmp-convert-{os.getppid()}"):
        (tmp_path / name).mkdir()
    removed = remove_stale(tmp_path, "convert")
    assert [p.name for p in removed] == [f".a.tmp-convert-{dead.pid}"]
    assert _hidden(tmp_path) == sorted([f".b.tmp-import-hf-{dead.pid}", f".c.tmp-convert-{os.getpid()}",
                                        f".d.tmp-convert-{os.getppid()}"])


def test_a_signal_during_building_in_process(tmp_path):
    out = tmp_path / "out"
    from conceptmoe.errors import Interrupted

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as e, building(out, "test") as tmp:
        (tmp / "x").write_text("half")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert e.value.exit_code == 128 + signal.SIGTERM
    assert not out.exists() and _hidden(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is restored


def test_a_report_file_is_replaced_whole(tmp_path):
    from conceptmoe.files import replacing, write_text

    path = tmp_path / "curves.png"
    write_text(path, "old")
    with pytest.raises(RuntimeError), replacing(path) as tmp:
        assert tmp.suffix == ".png"  # savefig goes by the extension
        tmp.write_text("half")
        raise RuntimeError("the plot failed")
    assert path.read_text() == "old" and _hidden(tmp_path) == []
    with replacing(path) as tmp:
        tmp.write_text("new")
    assert path.read_text() == "new" and _hidden(tmp_path) == []


def test_force_never_replaces_a_folder_in_use(sources, tmp_path, capsys):
    from conceptmoe.lock import RunLock

    run = tmp_path / "run"
    assert main(_argv("import-hf", sources, run)) == 0
    before = (run / "model.safetensors").read_bytes()
    with RunLock(run):  # e.g. `conceptmoe train --out run --resume` writing there
        for command in ("import-hf", "convert", "export-hf"):
            assert main([*_argv(command, sources, run), "--force"]) == 2
            assert "in use by another conceptmoe process" in capsys.readouterr().err
    assert (run / "model.safetensors").read_bytes() == before and _hidden(tmp_path) == []

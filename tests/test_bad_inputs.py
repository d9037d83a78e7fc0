"""Bad inputs of issue 19: each gives a one-line error and exit 2 (or the right result), and
nothing is left half-written. In-process (``conceptmoe.cli.main``) on tiny data."""

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from training_helpers import make_corpus

from conceptmoe import ModelConfig, build_model
from conceptmoe.cli import main
from conceptmoe.data import prepare as prep_mod
from conceptmoe.data.digits import VLM_DATA, build_tokenizer
from conceptmoe.data.tokenizer import save_tokenizer
from conceptmoe.files import file_mode
from conceptmoe.inference.generate import stream
from conceptmoe.training.checkpoint import RUN_FORMAT, RUN_VERSION, write_json
from test_whole_outputs import moe_run

TINY_TRAIN = ["--preset", "tiny", "--model", "moe", "--set", "vocab_size=300", "--batch-size", "2",
              "--seq-len", "32", "--device", "cpu", "--eval-every", "0", "--val-tokens", "64"]


def one_line_error(capsys, *words):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def last_line_error(capsys, *words):
    """Training prints its progress first (a bar, redrawn with carriage returns): one error line."""
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "Traceback" not in err, err
    line = err[err.index("error: "):].splitlines()[0]
    for w in words:
        assert w in line, err
    return line


def hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus") / "plays", n_docs=4, chars=4000)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    return moe_run(tmp_path_factory.mktemp("runs") / "moe")


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """A vision-language run as `train --data vlm-digits` writes it (random weights)."""
    run = tmp_path_factory.mktemp("runs") / "vlm"
    cfg = ModelConfig.from_preset("vlm", d_model=32, n_experts=4, expert_hidden=16, n_layers=3)
    model = build_model(cfg)
    run.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(run / "model.safetensors"))
    save_tokenizer(build_tokenizer(), run / "tokenizer.json")
    write_json(run / "config.json", {"format": RUN_FORMAT, "version": RUN_VERSION, "name": cfg.name,
                                     "model": cfg.to_dict(), "train": {"data": VLM_DATA, "seq_len": 128}})
    return run


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "data"
    assert main(["prepare", "--data", str(corpus), "--out", str(out), "--vocab-size", "256"]) == 0
    return out


# ----- prepare -----
@pytest.mark.parametrize("vocab", ["0", "1", "255", "10000000000"])
def test_prepare_vocab_size_refused_before_anything_is_written(corpus, tmp_path, capsys, vocab):
    out = tmp_path / "data"
    assert main(["prepare", "--data", str(corpus), "--out", str(out), "--vocab-size", vocab]) == 2
    one_line_error(capsys, "--vocab-size must be in [256,")
    assert not out.exists()  # no progress.json to block the corrected command
    assert main(["prepare", "--data", str(corpus), "--out", str(out), "--vocab-size", "256"]) == 0


def test_prepare_out_on_a_read_only_file_system(corpus, tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:  # a read-only folder refuses an ordinary user
        ro.chmod(0o555)
    else:  # root writes through chmod: the file system answers EROFS instead
        real_mkdir = os.mkdir

        def read_only(path, *args, **kwargs):
            if str(path).startswith(str(ro)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", read_only)
    try:
        assert main(["prepare", "--data", str(corpus), "--out", str(ro / "data")]) == 2
    finally:
        ro.chmod(0o755)
    one_line_error(capsys, str(ro / "data"))


def test_prepare_disk_full_then_a_rerun_resumes(corpus, tmp_path, capsys, monkeypatch):
    args = ["--data", str(corpus), "--vocab-size", "256", "--shard-tokens", "2000"]
    assert main(["prepare", *args, "--out", str(tmp_path / "whole")]) == 0
    real_write, calls = prep_mod.ShardWriter._write, []

    def fills_up(self, split, ids):
        calls.append(split)
        if len(calls) == 12:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.out / "train-00003.bin.tmp"))
        return real_write(self, split, ids)

    monkeypatch.setattr(prep_mod.ShardWriter, "_write", fills_up)
    out = tmp_path / "data"
    assert main(["prepare", *args, "--out", str(out)]) == 2
    last_line_error(capsys, "No space left on device")
    done = json.loads((out / "progress.json").read_text())["splits"]["train"]["shards"]
    assert done  # some shards were complete: the rerun continues after them
    monkeypatch.setattr(prep_mod.ShardWriter, "_write", real_write)
    assert main(["prepare", *args, "--out", str(out)]) == 0
    whole = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert json.loads((out / "manifest.json").read_text())["splits"] == whole["splits"]


def test_prepare_resume_checks_the_hashes_of_completed_shards(corpus, tmp_path, capsys, monkeypatch):
    args = ["prepare", "--data", str(corpus), "--vocab-size", "256", "--shard-tokens", "2000",
            "--out", str(tmp_path / "data")]
    real_close, closes = prep_mod.ShardWriter.close, []

    def stop_after_two(self, position, done):
        real_close(self, position, done)
        closes.append(1)
        if len(closes) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(prep_mod.ShardWriter, "close", stop_after_two)
    assert main(args) == 130
    monkeypatch.setattr(prep_mod.ShardWriter, "close", real_close)
    shard = tmp_path / "data" / "train-00000.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[::-1].tofile(shard)  # other valid ids, same size
    capsys.readouterr()
    assert main(args) == 2
    last_line_error(capsys, "train-00000.bin", "changed")


def test_prepare_a_parquet_file_with_a_damaged_page(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [f"Document {i}. " * 40 for i in range(300)]}), path,
                   row_group_size=100, compression="NONE")
    raw = bytearray(path.read_bytes())
    page = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    raw[page:page + 8] = bytes(b ^ 0xFF for b in raw[page:page + 8])  # the second row group's page header
    path.write_bytes(bytes(raw))
    assert main(["prepare", "--data", str(path), "--out", str(tmp_path / "data"), "--vocab-size", "256"]) == 2
    line = last_line_error(capsys, "damaged parquet data after row")
    assert line.isprintable()  # pyarrow's message can carry raw bytes
    assert not (tmp_path / "data").exists()


def test_prepare_refuses_a_word_level_tokenizer(vlm_run, text_run, corpus, tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["prepare", "--data", str(corpus), "--out", str(out), "--tokenizer",
                 str(vlm_run / "tokenizer.json")]) == 2
    one_line_error(capsys, "unknown token")
    assert not out.exists()
    assert main(["prepare", "--data", str(corpus), "--out", str(out), "--tokenizer",
                 str(text_run / "tokenizer.json")]) == 0  # a byte-level one is fine


# ----- train on prepared shards -----
def _copy_prepared(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.name != ".lock":
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_train_on_a_shard_holding_ids_outside_the_vocabulary(prepared, tmp_path, capsys):
    data = _copy_prepared(prepared, tmp_path / "data")
    shard = data / "train-00000.bin"
    np.full(shard.stat().st_size // 2, 1000, dtype="<u2").tofile(shard)  # same size, ids >= 300
    capsys.readouterr()
    assert main(["train", *TINY_TRAIN, "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "2"]) == 2
    last_line_error(capsys, "token id 1000", "outside the tokenizer's 256 entries")


def test_changed_shards_are_caught_by_their_hashes(prepared, tmp_path, capsys):
    data = _copy_prepared(prepared, tmp_path / "data")
    run = ["train", *TINY_TRAIN, "--data", str(data), "--out", str(tmp_path / "run"), "--save-every", "2"]
    assert main([*run, "--max-steps", "2", "--verify"]) == 0
    for f in ("model.safetensors", "checkpoints/step-00000002/optimizer.safetensors"):
        assert (tmp_path / "run" / f).stat().st_mode & 0o777 == file_mode()  # not safetensors' 0600
    shard = data / "train-00000.bin"
    np.fromfile(shard, dtype="<u2")[::-1].tofile(shard)  # other valid ids, same size
    capsys.readouterr()
    assert main([*run, "--max-steps", "4", "--resume"]) == 2  # a resume checks the hashes
    last_line_error(capsys, "does not match its hash")
    other = ["train", *TINY_TRAIN, "--data", str(data), "--out", str(tmp_path / "run2"), "--max-steps", "1"]
    assert main([*other, "--verify"]) == 2
    last_line_error(capsys, "does not match its hash")
    assert main(other) == 0  # sizes only: valid ids of the right count train (what --verify is for)


# ----- vision-language runs -----
def test_vision_language_runs_refuse_what_does_not_apply(vlm_run, corpus, tmp_path, capsys):
    text = corpus / sorted(os.listdir(corpus))[0]
    cases = [(["eval", str(vlm_run), "--tasks", "cmoe_nextline"], "vision-language"),
             (["eval", str(vlm_run), "--data", str(text), "--val-tokens", "100"], "--data, --val-tokens"),
             (["boundaries", str(vlm_run), "--examples", "100000"], "1 <= N <= 100"),
             (["train", "--init", str(vlm_run), "--data", str(text), "--out", str(tmp_path / "t"), "--device", "cpu"],
              "vision-language")]
    for argv, words in cases:
        assert main(argv) == 2, argv
        one_line_error(capsys, words)
    assert not (tmp_path / "t").exists()


# ----- generate -----
def test_generate_bounds(text_run, capsys):
    base = ["generate", str(text_run), "--prompt", "to be", "--device", "cpu"]
    assert main([*base, "--max-new-tokens", "100000000000"]) == 2
    one_line_error(capsys, "--max-new-tokens must be in [1, 1000000]")
    with pytest.raises(SystemExit) as e:  # argparse: usage line + one error line
        main([*base, "--seed", "99999999999999999999999"])
    assert e.value.code == 2 and "expected an integer in [0, 4294967295]" in capsys.readouterr().err
    assert main([*base, "--max-new-tokens", "3", "--seed", "4294967295"]) == 0


def test_a_huge_max_new_tokens_is_not_allocated_up_front(text_run):
    from conceptmoe import load_run

    model = load_run(text_run, "cpu")[0]
    steps = stream(model, torch.tensor([[5, 6, 7]]), max_new_tokens=10**11, temperature=0)
    assert [next(steps).tokens.shape for _ in range(3)] == [torch.Size([1])] * 3  # no 6 TB cache
    steps.close()


def test_generate_on_weights_holding_nan(text_run, tmp_path, capsys):
    run = tmp_path / "nan"
    run.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (run / name).write_bytes((text_run / name).read_bytes())
    w = load_file(text_run / "model.safetensors")
    key = sorted(w)[2]
    w[key].view(-1)[0] = float("nan")
    save_file(w, str(run / "model.safetensors"))
    assert main(["generate", str(run), "--prompt", "to be", "--device", "cpu"]) == 2
    one_line_error(capsys, key, "diverged")


# ----- convert / import-hf -----
def test_convert_ratio_is_capped_like_train(text_run, tmp_path, capsys):
    assert main(["convert", str(text_run), "--out", str(tmp_path / "cm"), "--ratio", "100"]) == 2
    one_line_error(capsys, "<= 64")
    assert not (tmp_path / "cm").exists()


def test_import_hf_refuses_a_nan_config_before_writing(text_run, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["export-hf", str(text_run), "--out", str(hf), "--arch", "qwen2_moe"]) == 0
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rms_norm_eps"] = float("nan")
    (hf / "config.json").write_text(json.dumps(cfg))  # Python writes NaN; transformers reads it
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["import-hf", str(hf), "--out", str(out)]) == 2
    one_line_error(capsys, "rms_norm_eps is nan")
    assert not out.exists() and hidden(tmp_path) == []

"""One-line errors for what used to end in a traceback, and small CLI conveniences."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_model

from conceptmoe import ModelConfig, build_model
from conceptmoe.cli import main
from conceptmoe.training import checkpoint as ck
from conceptmoe.data.tokenizer import save_tokenizer, train_tokenizer


def _run(folder, tokenizer_vocab=256):
    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    folder.mkdir()
    save_model(build_model(cfg), str(folder / "model.safetensors"))
    text = "To be, or not to be, that is the question. " * 20 + "".join(chr(0x4e00 + i) for i in range(400))
    save_tokenizer(train_tokenizer([text], tokenizer_vocab), folder / "tokenizer.json")
    ck.write_json(folder / "config.json", {"format": ck.RUN_FORMAT, "version": ck.RUN_VERSION,
                                           "model": cfg.to_dict(), "train": {}})
    return folder


def _one_line(capsys, argv, needle):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


@pytest.mark.parametrize("argv", [["generate", "RUN", "--prompt", "To be"], ["boundaries", "RUN", "--text", "To be"]])
def test_tokenizer_larger_than_vocab(tmp_path, capsys, argv):
    run = _run(tmp_path / "run", tokenizer_vocab=600)  # the tiny model has 256 entries
    _one_line(capsys, [str(run) if a == "RUN" else a for a in argv], "tokenizer.json has")


@pytest.mark.parametrize("flag", [["--temperature", "nan"], ["--temperature", "inf"], ["--top-p", "nan"]])
def test_generate_non_finite_flags(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["generate", str(tmp_path), "--prompt", "x", *flag])
    assert e.value.code == 2 and "finite" in capsys.readouterr().err


def test_bench_latency_zero_length_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "latency", "--preset", "tiny", "--prefill-lens", "0"])
    assert e.value.code == 2 and ">= 2" in capsys.readouterr().err


def test_boundaries_html_into_a_new_folder(tmp_path, capsys):
    run = _run(tmp_path / "run")
    page = tmp_path / "new" / "deeper" / "b.html"
    assert main(["boundaries", str(run), "--text", "To be, or not to be", "--html", str(page)]) == 0
    assert page.is_file() and "error" not in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("conceptmoe ")


def test_closed_pipe_is_quiet():
    # `conceptmoe flops ... | head -c 1`: the reader goes away before the output is written
    proc = subprocess.Popen([sys.executable, "-m", "conceptmoe", "match", "--baseline", "small", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait()
    assert "Traceback" not in err and "BrokenPipe" not in err, err

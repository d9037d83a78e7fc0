"""Flags refused before any work, in one line that names the flag (issue 41): a value given twice
(measured or trained twice), a duplicate ``--variants`` label (json keeps the last silently), a
``--plot`` that cannot be written (found only after the measurement), a ``CONCEPTMOE_CPU_BF16``
typo (ignored silently), and ModelConfig's errors as the flags the user gave."""

import pytest

from conceptmoe.cli import main
from conceptmoe.device import BF16_ENV, cpu_bf16_feature
from conceptmoe.errors import UserError
from conceptmoe.training.config import flag_error


def _refused(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert all(n in err for n in needles), err


def test_a_ratio_given_twice_is_refused(tmp_path, capsys):
    _refused(capsys, ["frontier", str(tmp_path / "run"), "--ratios", "2,3,2"], "--ratios", "each value once")
    _refused(capsys, ["compare", "--ratios", "2,2", "--out", str(tmp_path / "c")], "--ratios: each ratio once")
    assert not (tmp_path / "c").exists()
    with pytest.raises(SystemExit) as e:  # argparse: its own one-line usage error
        main(["bench", "latency", "--run", str(tmp_path / "run"), "--ratio", "2,2"])
    assert e.value.code == 2 and "each value once" in capsys.readouterr().err


def test_duplicate_variant_labels_are_refused(tmp_path, capsys):
    v = tmp_path / "v.json"
    v.write_text('{"mine": {"ratio": 2}, "other": {"ratio": 3}, "mine": {"ratio": 4}}')
    _refused(capsys, ["compare", "--variants", str(v), "--out", str(tmp_path / "c")], "'mine' is given twice")
    assert not (tmp_path / "c").exists()


def test_plot_folder_is_checked_before_the_measurement(tmp_path, capsys):
    # The run does not exist: the --plot error comes first, so nothing was measured.
    _refused(capsys, ["frontier", str(tmp_path / "run"), "--plot", str(tmp_path / "missing" / "f.png")],
             "--plot", "does not exist")
    _refused(capsys, ["frontier", str(tmp_path / "run"), "--plot", str(tmp_path)], "--plot", "is a folder")


def test_cpu_bf16_override_takes_0_or_1(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(BF16_ENV, "yes")
    with pytest.raises(UserError, match=f"{BF16_ENV}='yes': use 0 .* or 1"):
        cpu_bf16_feature()
    _refused(capsys, ["train", "--preset", "tiny", "--max-steps", "1", "--out", str(tmp_path / "t"),
                      "--device", "cpu"], BF16_ENV)
    assert not (tmp_path / "t").exists()
    monkeypatch.setenv(BF16_ENV, "1")
    assert cpu_bf16_feature() == f"{BF16_ENV}=1"


def test_model_config_errors_name_flags():
    assert str(flag_error(ValueError("ModelConfig.compression_ratio: must be > 1 (got 0.5)"))) == \
        "--ratio: must be > 1 (got 0.5)"
    assert str(flag_error(ValueError("ModelConfig.joint_layers: bad (got 9)"))).startswith("--set joint_layers: ")

"""Every subcommand answers -h; the console script is installed and runs."""

import subprocess
import sys

import pytest

from conceptmoe.cli import build_parser


def _subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_core_commands_registered():
    assert {"flops", "match"} <= set(_subcommands())


@pytest.mark.parametrize("cmd", _subcommands())
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([cmd, "-h"])
    assert e.value.code == 0
    assert "usage: conceptmoe" in capsys.readouterr().out


def test_console_entry_point():
    r = subprocess.run([sys.executable, "-m", "conceptmoe", "flops", "--preset", "tiny", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"total_params"' in r.stdout
    r = subprocess.run([sys.executable, "-m", "conceptmoe", "flops", "--preset", "nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr

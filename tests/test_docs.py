"""Docs that cannot drift: the CLI reference is the parser's, every ``conceptmoe`` command in the
README and docs/ parses with the real parser, and every relative link and image exists."""

import re
import shlex
from pathlib import Path

import pytest

from conceptmoe.cli import build_parser
from conceptmoe.cli.reference import render_reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md"))
SHELL = {"", "bash", "sh", "shell", "console"}  # code blocks read as commands (not ```text output)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SHELL_END = {"|", "||", "&&", ";", ">", ">>", "2>&1", "2>", "&", "<"}


def blocks(text: str) -> list[str]:
    """The shell code blocks of a markdown page."""
    out, cur, info = [], None, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if cur is None:
                cur, info = [], line.strip()[3:].strip()
            else:
                if info in SHELL:
                    out.append("\n".join(cur) + "\n")
                cur = None
        elif cur is not None:
            cur.append(line)
    return out


def commands(text: str) -> list[str]:
    """The ``conceptmoe ...`` invocations in a page's code blocks (continuation lines joined;
    also ``python -m conceptmoe`` and ``torchrun ... -m conceptmoe``)."""
    out = []
    for block in blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip().removeprefix("$ ")
            m = re.search(r"(?:^|\s|-m\s)conceptmoe\s+(.*)$", line)
            if m is None or line.startswith(("#", "pip ", "git ", "cd ", "ls ", "from ", "import ")):
                continue
            if "-m conceptmoe." in line or "/conceptmoe" in line.split("conceptmoe ")[0]:
                continue
            out.append(m.group(1))
    return out


def argv_of(cmd: str) -> list[str]:
    argv = []
    for tok in shlex.split(cmd, comments=True):
        if tok in SHELL_END or tok.startswith((">", "2>")):
            break
        argv.append(tok)
    return argv


def test_pages_hold_commands():
    """The check below checks something: the README's tour alone has many commands."""
    assert len(commands((ROOT / "README.md").read_text())) >= 12


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_parses(page, capsys):
    bad = []
    for cmd in commands(page.read_text(encoding="utf-8")):
        try:
            build_parser().parse_args(argv_of(cmd))
        except SystemExit as e:
            if e.code not in (0, None):  # --help exits 0
                bad.append(f"conceptmoe {cmd}: {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert not bad, "\n".join(bad)


def test_a_wrong_flag_is_caught(capsys):
    text = "```bash\nconceptmoe train --no-such-flag 3\n```\n"
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv_of(commands(text)[0]))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(page):
    missing = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.name}: {missing}"


def test_cli_reference_is_generated_from_the_parser():
    page = ROOT / "docs" / "cli.md"
    assert page.read_text(encoding="utf-8") == render_reference(), \
        "docs/cli.md differs from the parser: run `python -m conceptmoe.cli.reference docs/cli.md`"

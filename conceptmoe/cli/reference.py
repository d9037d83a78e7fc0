"""The CLI reference page (``docs/cli.md``), generated from the argparse parser itself.

``render_reference()`` walks ``build_parser()``: every subcommand (and every ``bench``
subcommand) with its full ``--help`` text at a fixed width, so the page does not depend on the
terminal that made it. ``tests/test_docs.py`` regenerates it and fails on any difference;
``python -m conceptmoe.cli.reference docs/cli.md`` rewrites it after a flag changes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

WIDTH = 100  # help text width: fixed, so the page is the same on every terminal


def _fixed_width(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH, max_help_position=32)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _sections(parser: argparse.ArgumentParser, path: list[str]) -> list[str]:
    out = []
    for name, sub in _subcommands(parser).items():
        here = path + [name]
        out.append(f"## `{' '.join(here)}`\n\n```text\n{_fixed_width(sub).format_help().rstrip()}\n```\n")
        out += _sections(sub, here)
    return out


def render_reference() -> str:
    from . import build_parser

    parser = _fixed_width(build_parser())
    head = ("# Command-line reference\n\n"
            "Generated from the argparse parser by `python -m conceptmoe.cli.reference docs/cli.md`; "
            "`tests/test_docs.py` fails when this page and the parser differ. Examples for each command "
            "are in the topic pages linked from the [README](../README.md).\n\n"
            f"```text\n{parser.format_help().rstrip()}\n```\n")
    return head + "\n" + "\n".join(_sections(parser, ["conceptmoe"]))


if __name__ == "__main__":
    text = render_reference()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)

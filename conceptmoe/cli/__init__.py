"""``conceptmoe`` command line: a thin argparse layer over the library.

Each module in this package registers its subcommands with ``register(subparsers)`` and sets
``func`` on its parser; ``func(args)`` returns an exit code. ``UserError``, ``ValueError`` and
file errors become a one-line ``error: ...`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import UserError
from . import bench, compute, generate, interop, training


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conceptmoe", description="Train, compare, run and benchmark ConceptMoE and MoE language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for group in (compute, training, generate, bench, interop):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``conceptmoe`` command line: a thin argparse layer over the library.

Each module in this package registers its subcommands with ``register(subparsers)`` and sets
``func`` on its parser; ``func(args)`` returns an exit code. ``UserError``, ``ValueError`` and
file errors become a one-line ``error: ...`` on stderr and exit code 2, and so does any other
``OSError`` (a read-only file system, a full disk); a run stopped by a signal (``Interrupted``)
prints one line and exits 128 + the signal.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..errors import Interrupted, UserError
from . import bench, compute, convert, frontier, generate, interop, prepare, serve, training


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conceptmoe", description="Train, compare, run and benchmark ConceptMoE and MoE language models.")
    parser.add_argument("--version", action="version", version=f"conceptmoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for group in (compute, prepare, training, generate, serve, bench, interop, convert, frontier):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return code
    except (UserError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into a reader that stopped (e.g. `| head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the exit flush does not fail again
        return 141
    except OSError as e:  # EROFS, ENOSPC, EDQUOT, EIO...: the system's reason and the path
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

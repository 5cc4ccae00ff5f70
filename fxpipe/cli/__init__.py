"""The ``fxpipe`` command: one module per subcommand, each with ``register``.

A subcommand module defines ``register(subparsers)``, which adds its parser and
sets ``func`` (called with the parsed args, returns an exit code). Errors a user
can act on (``FxpipeError``, a file that cannot be read or written, a wrong
option) print as one line without a traceback, and the exit code is 2;
``--debug`` shows the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, NoReturn, Optional

from passes.errors import FxpipeError

SUBCOMMANDS = ("profile", "plan", "split", "train", "show")


class _Parser(argparse.ArgumentParser):
    """argparse with its error on one line: ``fxpipe train: error: argument --steps: ...``.

    argparse prints the whole usage block above a wrong option; the line that
    matters is the last one, so the usage is replaced by a pointer to ``--help``.
    Subparsers inherit the class.
    """

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxpipe", description="Pipeline-parallel training for PyTorch models (PipeDream on torch.fx).")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"fxpipe.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name != f"fxpipe.cli.{name}_cmd":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FxpipeError, OSError) as exc:
        if args.debug:
            raise
        print(f"fxpipe {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (an OSError's own text already names the file)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and not isinstance(exc, FxpipeError):
        text = f"{exc.strerror or type(exc).__name__}: {exc.filename}" if exc.filename else text
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())

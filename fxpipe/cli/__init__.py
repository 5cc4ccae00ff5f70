"""The ``fxpipe`` command: one module per subcommand, each with ``register``.

A subcommand module defines ``register(subparsers)``, which adds its parser and
sets ``func`` (called with the parsed args, returns an exit code). Errors a user
can act on (``FxpipeError``) print as one message without a traceback;
``--debug`` shows it.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from passes.errors import FxpipeError

SUBCOMMANDS = ("profile", "plan", "split", "train", "show")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxpipe", description="Pipeline-parallel training for PyTorch models (PipeDream on torch.fx).")
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
    except (FxpipeError, FileNotFoundError) as exc:
        if args.debug:
            raise
        print(f"fxpipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

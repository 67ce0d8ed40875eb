"""The ``cerar`` command line: a thin entry point over one module per command.

Each sub-command lives in its own module with ``add_parser(subparsers)`` and ``run(args)``;
modules load only when their command runs, so ``cerar design`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from cerar.experiments._extras import MissingExtraError

COMMANDS: dict[str, str] = {
    "design": "cerar.cli.design",
    "bench": "cerar.cli.bench",
    "train": "cerar.cli.train",
    "study": "cerar.cli.study",
    "plan": "cerar.cli.plan",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cerar", description="Coded approximate ring all-reduce.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=f"see `cerar {name} --help`")
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only=command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command])
    try:
        return int(module.run(args) or 0)
    except (ValueError, TypeError, MissingExtraError) as exc:  # a missing extra's message names it
        print(f"cerar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    # The commands check their arguments and paths up front (status 2 above); these are what the
    # machine refused later (a disk filled, a file vanished, memory ran out), not a bug to trace.
    except OSError as exc:
        print(f"cerar {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError as exc:
        print(f"cerar {args.command}: error: out of memory: {exc or 'an allocation failed'}", file=sys.stderr)
        return 1

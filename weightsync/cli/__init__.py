"""The ``weightsync`` command: one argparse layer that dispatches to sub-command modules.

Each sub-command lives in the package that owns it and exposes ``add_arguments(parser)`` and
``main(args) -> int``; this module only wires them (imports are lazy so that ``weightsync list``
does not import torch).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from weightsync.cli.usage import OVERVIEW, USAGE, HelpFormatter, description, epilog

SUBCOMMANDS: dict[str, str] = {
    "list": "weightsync.cli.models",
    "plan": "weightsync.cli.plan",
    "serve": "weightsync.cli.serve",
    "prepare": "weightsync.cli.prepare",
    "run": "weightsync.cli.run",
    "bench": "weightsync.cli.bench",
}
"""Sub-command -> its module; what each says in help is :data:`weightsync.cli.usage.USAGE`'s."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description=OVERVIEW, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        u = USAGE[name]
        p = sub.add_parser(name, help=u.summary, description=description(name), epilog=epilog(name),
                           formatter_class=HelpFormatter)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"weightsync {args.command}: not available in this build", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).main(args) or 0)


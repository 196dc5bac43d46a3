"""The ``weightsync`` command: one argparse layer that dispatches to sub-command modules.

Each sub-command lives in the package that owns it and exposes ``add_arguments(parser)`` and
``main(args) -> int``; this module only wires them (imports are lazy so that ``weightsync list``
does not import torch).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "list": ("weightsync.cli.models", "list the models and their run profiles"),
    "plan": ("weightsync.cli.plan", "compute (and verify) a transfer plan"),
    "serve": ("weightsync.cli.serve", "start the built-in rollout engine"),
    "prepare": ("weightsync.cli.prepare", "write the HF and trainer-sharded checkpoints"),
    "run": ("weightsync.cli.run", "train and update rollout engines every step"),
    "bench": ("weightsync.cli.bench", "transfer benchmarks"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
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


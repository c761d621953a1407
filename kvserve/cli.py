"""`kvserve` command line: generate | chat | serve | bench | plan | simulate | perplexity | router | proxy.

Each subcommand lives beside the code it drives and registers itself here through a
`register(subparsers)` function, so this file only wires them together.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from kvserve.config.cli_args import ArgumentParser, kvserve_version

# Modules that define `register(subparsers)`; each adds one or more subcommands.
COMMAND_MODULES = [
    "kvserve.entrypoints.generate",     # generate, bench throughput
    "kvserve.entrypoints.chat",         # chat
    "kvserve.entrypoints.serve",        # serve (one server, or N replicas with --data-parallel-size N)
    "kvserve.analysis.cli",             # plan, simulate
    "kvserve.quality.perplexity",       # perplexity
    "kvserve.fleet.router_cli",         # router, proxy
]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvserve {kvserve_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:     # bad flags or input: the message says what to change
        print(f"kvserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

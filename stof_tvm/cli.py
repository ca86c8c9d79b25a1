"""The ``stof-tvm`` command line: one subcommand per module in :mod:`stof_tvm.commands`."""
from __future__ import annotations

import argparse
import importlib
import sys

from stof_tvm.hardware import DeviceUnavailable

# Each entry names a module of stof_tvm.commands that exposes ``register(subparsers)``; the subparser it adds
# sets ``func`` (a callable taking the parsed args and returning an exit code).
COMMANDS = [
    "masks",
    "compile",
    "run",
    "bench",
    "rpc",
    "tune",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stof-tvm",
        description="Compile transformers with sparse attention masks into fast CUDA modules (Apache TVM).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMANDS:
        importlib.import_module(f"stof_tvm.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, DeviceUnavailable) as err:
        print(f"stof-tvm {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stof-tvm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

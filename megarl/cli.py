"""`megarl` command line: one entry point, one module per subcommand in megarl/commands/.

Subcommand modules are imported only when chosen, so `megarl --help` stays fast
and a subcommand never pays for another's heavy imports (Megatron, vLLM).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from megarl.errors import MegarlError

# subcommand name -> module under megarl.commands that defines `register(subparsers)`
SUBCOMMANDS = {
    "train": "train",
    "init-checkpoint": "init_checkpoint",
    "logprobs": "logprobs",
    "generate": "generate",
    "engine": "engine",
    "verify-recovery": "verify_recovery",
    "bench": "bench",
    "advise": "advise",
    "launch": "launch",
    "plan": "plan",
    "prepare-data": "prepare_data",
    "export-hf": "export_hf",
    "trust-checkpoint": "trust_checkpoint",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl",
                                     description="Asynchronous RL post-training with exact old-logit recovery.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=f"(run `megarl {name} --help`)")
            continue
        try:
            mod = importlib.import_module(f"megarl.commands.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"megarl.commands.{module}":
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    parser = build_parser(only=chosen)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if not argv else 2
    try:
        return int(args.func(args) or 0)
    except MegarlError as e:
        print(f"megarl {args.command}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # a run stopped by a signal has its own (megarl/loop/run_stop.py)


if __name__ == "__main__":
    sys.exit(main())

"""`rimuru` command line. Each subcommand lives in its own module under rimuru.commands with
``configure(parser)`` and ``run(args) -> int``; modules are imported only when used so that
``rimuru --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Add a subcommand by adding a module and a line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "version": ("rimuru.commands.version", "print the version and the torch/triton/device it sees"),
    "pool": ("rimuru.commands.pool", "build a page pool for a model config and check its allocator"),
    "checkpoint": ("rimuru.commands.checkpoint", "write a seeded synthetic HF checkpoint for a model"),
    "profile": ("rimuru.commands.profile", "measure a model's expert hotset (per-layer routing order)"),
    "workload": ("rimuru.commands.workload", "write a deterministic request trace (JSONL) for a seed"),
    "serve": ("rimuru.commands.serve", "run the OpenAI-compatible server"),
    "bench": ("rimuru.commands.bench", "load-generate against a server or the in-process engine"),
}


class UserError(Exception):
    """A mistake in the user's input: printed as one line, exit status 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rimuru",
        description="Rimuru: MoE serving with one elastic page pool for experts, KV cache and states.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)  # prints help / "invalid choice" and exits
        parser.print_help()
        return 0 if args.command is None and not argv else 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"rimuru {name}", description=COMMANDS[name][1],
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    module.configure(sub)
    args = sub.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except (UserError, FileNotFoundError, ValueError) as exc:
        print(f"rimuru {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

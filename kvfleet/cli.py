"""One command for the fleet, like `vllm serve` and `vllm run-batch`:

    kvfleet submit FILE [...]        validate a JSONL file and enqueue it as a batch
    kvfleet status [BATCH] [--watch] recent batches, one batch, or a progress bar to its end
    kvfleet api [...]                the OpenAI-compatible API (and the console under /ui)
    kvfleet worker --model PATH ...  one worker: one GPU or tensor-parallel group
    kvfleet finalizer [...]          assemble finished batches' output files
    kvfleet serve --model PATH       API + worker + finalizer in one command
    kvfleet run-batch -i IN -o OUT   a JSONL file through one engine, no Redis
    kvfleet demo                     the whole fleet on the demo model

Each subcommand is the module's own CLI (`kvfleet worker --help` is `python -m workers
--help`); the `python -m ...` forms keep working. A module is imported only when its
subcommand runs, so `kvfleet status` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {  # subcommand -> (module with main(argv), one line of help)
    "submit": ("producers.submit", "validate a JSONL file and enqueue it as a batch"),
    "status": ("producers.status", "recent batches, one batch, or --watch one to its end"),
    "api": ("producers.api", "the OpenAI-compatible API and the console (/ui)"),
    "worker": ("workers.__main__", "one worker: one GPU or tensor-parallel group"),
    "finalizer": ("workers.finalizer", "assemble finished batches' output files"),
    "serve": ("workers.serve", "API + worker + finalizer in one command"),
    "run-batch": ("workers.run_batch", "a JSONL file through one engine, no Redis"),
    "demo": ("workers.demo", "the whole fleet on the demo model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description="kvfleet: a self-hosted LLM inference fleet.",
                                     epilog="`kvfleet COMMAND --help` shows a command's options.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)  # --help goes to the module's parser
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if argv is None and args.command in ("worker", "run-batch"):
        from workers.allocator import reexec_with_allocator  # noqa: PLC0415 (these two only)

        reexec_with_allocator()  # as `python -m workers` does: LD_PRELOAD is read when a process starts
    module = importlib.import_module(COMMANDS[args.command][0])
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())

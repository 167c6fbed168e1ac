"""Entry point of the `gspo` command; each command group lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes register(subparsers); a command sets `func(args) -> int` on its parser.
COMMAND_MODULES = [
    "gspo_cli.train_cmd",  # gspo train job.yaml (local, no service)
    "gspo_cli.service_cmd",  # gspo up | gspo api | gspo worker | gspo admin ...
    "gspo_cli.client_cmd",  # gspo files|jobs|checkpoints ... (talks to the API)
    "gspo_cli.models_cmd",  # gspo models import PATH (a GGUF file or an HF directory into the models directory)
    "gspo_cli.serve_cmd",  # gspo serve <fine_tuned_model | checkpoint id> (vLLM's OpenAI-compatible server)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gspo", description="GSPO training as a service.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

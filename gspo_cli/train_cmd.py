"""`gspo train job.yaml`: the library's local training command, under the one `gspo` entry point."""

from __future__ import annotations


def register(sub) -> None:
    from gspo_core.cli import add_train_arguments, run_train

    p = sub.add_parser("train", help="run a GSPO job locally (no service needed)")
    add_train_arguments(p)
    p.set_defaults(func=run_train)

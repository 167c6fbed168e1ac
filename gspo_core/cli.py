"""`gspo train job.yaml`: run a GSPO job locally (no database, broker or server) with a progress bar.

The YAML holds JobSpec's fields (model, training_file, validation_file, reward, hyperparameters,
output_dir). ``model: toy`` (or ``toy:small``) builds a tiny local model under the output directory,
and ``training_file: toy`` writes the toy dataset, so the example runs with no downloads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from gspo_core.callbacks import Callbacks, CallbackList
from gspo_core.config import JobSpec


class MetricsFile(Callbacks):
    """Appends each step's metrics to ``metrics.jsonl``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", buffering=1)

    def on_step(self, step, metrics):
        self.f.write(json.dumps({"step": step, **metrics}) + "\n")


class ProgressBar(Callbacks):
    """A tqdm bar: step, reward, step time, ETA."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def on_step(self, step, metrics):
        self.bar.n = step
        self.bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step']:.2f}")

    def on_checkpoint(self, step, path, final):
        self.bar.write(f"checkpoint: {path}")

    def on_log(self, message):
        self.bar.write(message)


def parse_set(pairs: list[str]) -> dict:
    """``--set key=value`` pairs, values parsed as YAML (numbers, booleans, lists)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def load_spec(path: str, output_dir: str | None, overrides: dict) -> JobSpec:
    raw = yaml.safe_load(Path(path).read_text()) or {}
    raw["hyperparameters"] = {**(raw.get("hyperparameters") or {}), **overrides}
    if output_dir:
        raw["output_dir"] = output_dir
    out = Path(raw.get("output_dir", "runs/job"))
    if str(raw.get("model", "")).startswith("toy"):
        from gspo_core.toy import build_tiny_model

        shape = raw["model"].split(":", 1)[1] if ":" in raw["model"] else "toy"
        raw["model"] = str(build_tiny_model(out / f"{shape}-model", shape=shape))
    if raw.get("training_file") == "toy":
        from gspo_core.toy import write_toy_dataset

        raw["training_file"] = str(write_toy_dataset(out / "toy.jsonl", n=64))
    return JobSpec(**raw)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job YAML (JobSpec fields)")
    p.add_argument("--output-dir", help="overrides output_dir")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a hyperparameter")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in output_dir")


def run_train(args: argparse.Namespace) -> int:
    from gspo_core.checkpoint import latest_checkpoint
    from gspo_core.trainer import train

    spec = load_spec(args.job, args.output_dir, parse_set(args.set))
    out = Path(spec.output_dir)
    resume = latest_checkpoint(out) if args.resume else None
    cb = CallbackList(MetricsFile(out / "metrics.jsonl"), ProgressBar(spec.hyperparameters.steps))
    result = train(spec, cb, resume_from=resume)
    print(json.dumps({"final_step": result.final_step, "checkpoint": result.final_checkpoint,
                      "reward/mean": result.metrics.get("reward/mean")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo_core")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run a GSPO job locally")
    add_train_arguments(p)
    args = parser.parse_args(argv)
    return run_train(args)

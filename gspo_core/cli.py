"""`gspo train job.yaml`: run a GSPO job locally (no database, broker or server) with a progress bar.

    gspo train job.yaml [--output-dir D] [--set key=value ...] [--resume] [--rollout-engine E] ...
    python -m gspo_core train job.yaml ...

The YAML holds JobSpec's fields (model, training_file, validation_file or environment, reward, hyperparameters,
output_dir, name), and optionally a ``runtime:`` section: how this machine runs the job
(`gspo_core.platform.RuntimeOptions`: rollout_engine, vllm_gpu_memory_utilization, keep_freed_memory),
which the flags ``--rollout-engine``, ``--vllm-gpu-memory-utilization`` and ``--return-freed-memory``
override. ``--set`` overrides a hyperparameter (``--set learning_rate=1e-5``) or a
top-level field (``--set model=/path``). ``model: toy`` (or ``toy:small``) builds a tiny local
model under the output directory and ``training_file: toy`` writes the toy dataset, so
``examples/toy_job.yaml`` runs with no downloads. The output directory receives ``metrics.jsonl``
(one JSON object per step) and ``checkpoints/step-XXXXXX/``; ``--resume`` continues from the
newest checkpoint there. Bad input exits with status 2 and a message naming the field or line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import TextIO

import yaml

from gspo_core.callbacks import CallbackList, Callbacks, Evaluation
from gspo_core.config import JobSpec
from gspo_core.platform import ENGINE_KINDS, RuntimeOptions


class MetricsFile(Callbacks):
    """Appends each step's metrics to ``metrics.jsonl`` (a resumed run first drops the lines of
    steps it is about to redo, so every step appears once)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file: TextIO | None = None

    def on_step(self, step, metrics):
        if self.file is None:
            kept = [
                line
                for line in (self.path.read_text().splitlines() if self.path.exists() else [])
                if line.strip() and json.loads(line).get("step", 0) < step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
            self.file = open(self.path, "a", buffering=1)  # noqa: SIM115 -- open for the run; close() closes it
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class ProgressBar(Callbacks):
    """A tqdm bar on stderr: step, reward, step time and ETA (a resumed run counts from its step)."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.started = False
        self.before: Evaluation | None = None  # the held-out evaluation before training, for "before -> after"

    def on_step(self, step, metrics):
        if step == 0:  # the held-out evaluation before training (on_evaluation prints it)
            return
        if not self.started and step > 1:  # resumed: rate and ETA cover only this run's steps
            self.bar.initial = self.bar.n = step - 1
            self.bar.start_t = self.bar.last_print_t = self.bar._time()
        self.started = True
        self.bar.set_postfix(
            reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step']:.2f}", refresh=False
        )
        self.bar.update(step - self.bar.n)

    def on_checkpoint(self, step, path, final):
        self.bar.write(f"checkpoint: {path}")

    def on_log(self, message):
        self.bar.write(message)

    def on_evaluation(self, evaluation):
        if evaluation.when == "before":
            self.before = evaluation
        numbers = []
        for key in ("greedy_reward", "sampled_reward", "loss"):
            value, was = getattr(evaluation, key), getattr(self.before, key, None)
            if value is not None:
                shown = (
                    f"{was:.3f} -> {value:.3f}" if evaluation.when == "after" and was is not None else f"{value:.3f}"
                )
                numbers.append(f"{key.replace('_', ' ')} {shown}")
        self.bar.write(f"held-out evaluation {evaluation.when} training: {', '.join(numbers)}")

    def close(self) -> None:
        self.bar.close()


def parse_set(pairs: list[str]) -> dict:
    """``--set key=value`` pairs, values parsed as YAML (numbers, booleans, lists)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


TOP_LEVEL = {"model", "training_file", "validation_file", "environment", "reward", "output_dir", "name", "resources"}


def apply_overrides(raw: dict, overrides: dict) -> dict:
    """``--set`` keys: JobSpec fields (``model``, ``output_dir``...) go top level; everything else,
    bare or as ``hyperparameters.x``, is a hyperparameter."""
    raw = dict(raw)
    hyperparameters = dict(raw.get("hyperparameters") or {})
    for key, value in overrides.items():
        if key in TOP_LEVEL:
            raw[key] = value
        else:
            hyperparameters[key.removeprefix("hyperparameters.")] = value
    raw["hyperparameters"] = hyperparameters
    return raw


def load_job(
    path: str, output_dir: str | None, overrides: dict, runtime_flags: dict | None = None
) -> tuple[JobSpec, RuntimeOptions]:
    """The job YAML as a JobSpec (see :func:`_spec`) and its ``runtime:`` section as RuntimeOptions,
    ``runtime_flags`` (the command's flags that were given) over it."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of JobSpec fields")
    section = raw.pop("runtime", None) or {}
    if not isinstance(section, dict):
        raise ValueError(f"{path}: runtime: expected a mapping of {', '.join(f.name for f in fields(RuntimeOptions))}")
    try:
        runtime = RuntimeOptions.from_mapping({**section, **(runtime_flags or {})})
    except ValueError as exc:
        raise ValueError(f"runtime: {exc}") from None
    return _spec(raw, output_dir, overrides), runtime


#: The flag of each runtime option.
RUNTIME_FLAGS = {
    "rollout_engine": "--rollout-engine",
    "vllm_gpu_memory_utilization": "--vllm-gpu-memory-utilization",
    "keep_freed_memory": "--return-freed-memory",
}


def _spec(raw: dict, output_dir: str | None, overrides: dict) -> JobSpec:
    """The job's fields with ``--set``/``--output-dir`` applied; ``model: toy[:shape]`` builds a tiny
    local model and ``training_file: toy`` writes the toy dataset (both under the output dir)."""
    raw = apply_overrides(raw, overrides)
    if moved := sorted(set(raw["hyperparameters"]) & set(RUNTIME_FLAGS)):  # earlier versions took them there
        raise ValueError(
            f"hyperparameters.{moved[0]}: how this machine runs jobs is not a hyperparameter; set it "
            f"in the job's runtime: section or with {RUNTIME_FLAGS[moved[0]]}"
        )
    if output_dir:
        raw["output_dir"] = output_dir
    out = Path(raw.get("output_dir", "runs/job"))
    model = str(raw.get("model", ""))
    if model == "toy" or model.startswith("toy:"):
        from gspo_core.toy import build_tiny_model

        shape = model.split(":", 1)[1] if ":" in model else "toy"
        raw["model"] = str(build_tiny_model(out / f"{shape}-model", shape=shape))
    if raw.get("training_file") == "toy":
        from gspo_core.toy import write_toy_dataset

        raw["training_file"] = str(write_toy_dataset(out / "toy.jsonl", n=64))
    return JobSpec(**raw)


def describe_error(exc: Exception) -> str:
    """One readable line per problem, naming the field (pydantic) or line (dataset)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'job'}: {error['msg']}" for error in exc.errors()
        )
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="job YAML (JobSpec fields)")
    parser.add_argument("--output-dir", help="overrides output_dir")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a hyperparameter")
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in output_dir")
    parser.add_argument(
        "--devices", type=int, help="devices (trainer ranks) to run on; overrides resources.devices (default 1)"
    )
    parser.add_argument(
        "--rollout-engine",
        choices=ENGINE_KINDS,
        help="auto (default) = vLLM when installed, else transformers generate",
    )
    parser.add_argument(
        "--vllm-gpu-memory-utilization", type=float, help="share of GPU memory vLLM takes (default 0.3)"
    )
    parser.add_argument(
        "--return-freed-memory",
        dest="keep_freed_memory",
        action="store_false",
        default=None,
        help="CPU: let glibc return freed memory to the OS (default: the process keeps it, faster steps)",
    )


def runtime_flags(args: argparse.Namespace) -> dict:
    """The runtime options given as flags (None: not given)."""
    return {name: getattr(args, name) for name in RUNTIME_FLAGS if getattr(args, name, None) is not None}


def job_overrides(args: argparse.Namespace) -> dict:
    """``--set`` pairs, with ``--devices`` as ``resources.devices``."""
    overrides = parse_set(args.set)
    if getattr(args, "devices", None) is not None:
        overrides["resources"] = {"devices": args.devices}
    return overrides


def run_train(args: argparse.Namespace) -> int:
    """Run the job: here alone, or as rank 0 of ``resources.devices`` ranks (`gspo_core.launch.other_ranks`
    starts the others, each this command on the job's ``ranks.yaml``); rank 0 reports."""
    from gspo_core.checkpoint import latest_checkpoint
    from gspo_core.launch import RankLost, other_ranks
    from gspo_core.platform import prepare_process
    from gspo_core.trainer import train

    try:
        spec, runtime = load_job(args.job, args.output_dir, job_overrides(args), runtime_flags(args))
    except (OSError, ValueError, yaml.YAMLError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"error: {describe_error(exc)}", file=sys.stderr)
        return 2
    prepare_process(runtime)  # this command owns its process
    out = Path(spec.output_dir)
    resume = latest_checkpoint(out) if args.resume else None
    # Rank 0 shows progress and writes metrics.jsonl; ranks it started have callbacks that do nothing.
    main_rank = int(os.environ.get("RANK", "0")) == 0
    shown: list[MetricsFile | ProgressBar] = []
    if main_rank:
        shown = [MetricsFile(out / "metrics.jsonl"), ProgressBar(spec.hyperparameters.steps)]
    try:
        with other_ranks(spec, args.resume, out, runtime):
            result = train(spec, CallbackList(*shown), resume_from=resume, runtime=runtime)
    except RankLost as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError) as exc:  # bad data, reward spec, model or loss name
        print(f"error: {describe_error(exc)}", file=sys.stderr)
        return 2
    finally:
        for callback in shown:
            callback.close()
    if main_rank:
        print(
            json.dumps(
                {
                    "final_step": result.final_step,
                    "checkpoint": result.final_checkpoint,
                    "stopped": result.stopped,
                    "reward/mean": result.metrics.get("reward/mean"),
                }
            )
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo_core")
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser = sub.add_parser("train", help="run a GSPO job locally")
    add_train_arguments(train_parser)
    args = parser.parse_args(argv)
    return run_train(args)

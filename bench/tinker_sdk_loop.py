"""`python -m bench.tinker_sdk_loop`: a tinker-cookbook-style RL loop through the HTTP Tinker API (issue 38).

A live `gspo api` and session worker (``--service-root``: the checkout they run, e.g. an older commit's export, to
compare) on the toy model and toy task; the unmodified `tinker` SDK runs each step as the cookbook's
``rl/train.py`` does: ``save_weights_for_sampler`` -> a sampling client -> one ``sample`` future per prompt, all
in flight at once -> graded (the toy task's similarity) -> group-normalised advantages -> ``importance_sampling``
``forward_backward`` + ``optim_step``. Reports each step's wall seconds, the service's CPU seconds (api and worker
process trees, from /proc) and sampled tokens, and the worker tree's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import psutil

from bench.workload import similarity
from gspo_core.toy import build_tiny_model, write_toy_dataset
from store.db import Database, run_migrations
from store.settings import Settings
from store.tenants import create_tenant_and_key

ROOT = Path(__file__).resolve().parent.parent


def tree_cpu(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` and their live descendants (and children they reaped)."""
    total = 0.0
    for proc in procs:
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.NoSuchProcess:
                pass
    return total


def tree_peak_rss(proc: psutil.Process) -> float:
    """MB: the sum of the peak RSS (VmHWM) of ``proc`` and its live descendants."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        status = Path(f"/proc/{p.pid}/status").read_text()
        total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    return total / 1024


def start_service(stack: ExitStack, tmp: Path, model: Path, root: Path, engine: str) -> tuple[str, str, list]:
    settings = Settings(data_dir=tmp, models_dir=model.parent)
    run_migrations(settings.resolved_database_url())
    db = Database(settings.resolved_database_url())
    with db.session() as s:
        key = create_tenant_and_key(s, "bench")[1]
    db.dispose()
    env = {
        **os.environ,
        "GSPO_DATA_DIR": str(tmp),
        "GSPO_MODELS_DIR": str(model.parent),
        "GSPO_ROLLOUT_ENGINE": engine,
        "GSPO_WORKER_MODE": "sessions",
        "TINKER_TELEMETRY": "0",
        "PYTHONPATH": str(root),
    }
    port = 18000 + os.getpid() % 1000
    procs = []
    for name, args in {"api": ["api", "--host", "127.0.0.1", "--port", str(port)], "worker": ["worker"]}.items():
        log = stack.enter_context((tmp / f"{name}.log").open("w"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "gspo_cli.main", *args], env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT
        )
        stack.callback(proc.wait)
        stack.callback(proc.terminate)
        procs.append(psutil.Process(proc.pid))
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    return url, key, procs


def step_data(tinker_types, rows, results, tokenizer):
    """Datums of every sampled sequence (prompt + completion, the sampler's log-probs, group advantages)."""
    data, rewards = [], []
    for row, prompt, result in zip(rows, *results, strict=True):
        scores = [similarity(tokenizer.decode(seq.tokens, skip_special_tokens=True), row["target"]) for seq in result]
        rewards += scores
        mean = statistics.fmean(scores)
        for seq, score in zip(result, scores, strict=True):
            if score == mean or not seq.tokens:
                continue
            tokens = [*prompt, *seq.tokens]
            pad = [0.0] * (len(prompt) - 1)
            data.append(
                tinker_types.Datum(
                    model_input=tinker_types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": pad + list(seq.logprobs),
                        "advantages": pad + [score - mean] * len(seq.tokens),
                    },
                )
            )
    return data, statistics.fmean(rewards)


def run(args: argparse.Namespace) -> dict:
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="tinker-loop-"))
    model = build_tiny_model(tmp / "models" / "toy", shape="toy", seed=0)
    rows = [json.loads(line) for line in write_toy_dataset(tmp / "toy.jsonl", n=256, seed=0).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    steps = []
    with ExitStack() as stack:
        url, key, procs = start_service(stack, tmp / "service", model, Path(args.service_root), args.engine)
        service = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
        stack.callback(lambda: service.close("success").result(timeout=120))
        training = service.create_lora_training_client(base_model="toy", rank=8, seed=0).result()
        params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0)
        peak = 0.0
        for step in range(args.steps):
            batch = rows[step * args.prompts : (step + 1) * args.prompts]
            wall0, cpu0 = time.monotonic(), tree_cpu(procs)
            path = training.save_weights_for_sampler(f"step{step}").result().path
            sampler = service.create_sampling_client(model_path=path).result()
            prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in batch]
            futures = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
            results = [f.result().sequences for f in futures]
            data, reward = step_data(types, batch, (prompts, results), tokenizer)
            if data:
                fb = training.forward_backward(data, "importance_sampling")
                opt = training.optim_step(types.AdamParams(learning_rate=args.lr))
                fb.result()
                opt.result()
            peak = max(peak, tree_peak_rss(procs[1]))
            steps.append(
                {
                    "wall_s": time.monotonic() - wall0,
                    "cpu_s": tree_cpu(procs) - cpu0,
                    "tokens": sum(len(q.tokens) for r in results for q in r),
                    "reward": reward,
                }
            )
            print(json.dumps({"step": step + 1, **steps[-1]}), flush=True)
    later = steps[1:] or steps
    return {
        "service_root": args.service_root,
        "engine": args.engine,
        "steps": steps,
        "median_wall_s": statistics.median(s["wall_s"] for s in later),
        "median_cpu_s": statistics.median(s["cpu_s"] for s in later),
        "worker_peak_rss_mb": peak,
        "load": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--service-root", default=str(ROOT), help="the checkout whose `gspo api` and worker run")
    p.add_argument("--engine", default="vllm", choices=("vllm", "transformers"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    print(json.dumps(run(p.parse_args()), indent=1))


if __name__ == "__main__":
    main()

"""`python -m bench.real_model`: does a real pretrained model learn? Ours (`gspo`, `grpo`) vs TRL (GSPO mode).

SmolLM2-135M-Instruct (bench.smollm2) by default, on reasoning-gym tasks through our environment code; the same
model, items, sampling and update budget for every trainer. Each run is a fresh subprocess (clean memory
numbers); the held-out items are the same for every run, evaluated greedily by one evaluator before (once per
task) and after each run. Results go to bench/results/ as JSON, a Markdown table and a PNG plot.
``--one TRAINER`` runs a single trainer (``base``: evaluates the untrained model), as the parent asks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.real_trainers import TASKS, TRAINERS, RealWorkload
from bench.run import child_run

RESULTS = Path(__file__).resolve().parent / "results"


def _child(trainer: str, w: RealWorkload, root: str, engine: str) -> dict:
    return child_run("bench.real_model", trainer, ["--workload", w.to_json(), "--root", root, "--engine", engine])


def run_one(trainer: str, w: RealWorkload, root: Path, engine: str) -> dict:
    """In this process: one trainer's run and its final model's held-out accuracy, or (``base``) the
    untrained model's."""
    from bench.real_trainers import greedy_accuracy, rows, run_ours, run_trl

    _, held_out = rows(w)
    if trainer == "base":
        return {"trainer": "base", "eval": greedy_accuracy(w.model_dir, held_out, w.tokens)}
    res = run_trl(w, root) if trainer == "trl" else run_ours(w, root, trainer, engine)
    res["eval"] = greedy_accuracy(res.pop("final_model"), held_out, w.tokens)
    shutil.rmtree(root / f"out-{trainer}-{w.task}-{w.seed}", ignore_errors=True)  # 0.5-1.5 GB of weights
    return res


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict], before: dict[str, float]) -> dict:
    """Per task and trainer: held-out accuracy before -> after (mean over seeds, and each seed's), median step
    time (step 1 excluded: engine warm-up), peak RSS, the reward curve, clip fraction and log-prob gap."""
    out: dict = {}
    for task in sorted({r["task"] for r in runs}):
        out[task] = {"before": before.get(task)}
        for name in TRAINERS:
            mine = [r for r in runs if r["task"] == task and r["trainer"] == name]
            if not mine:
                continue
            curves = [r["reward"] for r in mine]
            out[task][name] = {
                "after": statistics.mean(r["eval"]["accuracy"] for r in mine),
                "after_per_seed": {str(r["seed"]): r["eval"]["accuracy"] for r in mine},
                "steps_done": [r["steps_done"] for r in mine],
                "step_s_median": _med([s for r in mine for s in (r["step_s"][1:] or r["step_s"])]),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
                "reward_curve": [statistics.mean(c[i] for c in curves) for i in range(min(map(len, curves)))],
                "clip_frac_median": _med([c for r in mine for c in r["clip_frac"]]),
                "logprob_gap_max": max((g for r in mine for g in r["logprob_gap"] if g is not None), default=None),
            }
        ours, trl = out[task].get("ours-gspo"), out[task].get("trl")
        if ours and trl and ours["step_s_median"] and trl["step_s_median"]:
            out[task]["step_ratio_ours_gspo_over_trl"] = ours["step_s_median"] / trl["step_s_median"]
    return out


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(w: RealWorkload, s: dict, load: str) -> str:
    lines = [
        f"Model {Path(w.model_dir).name}; {w.prompts} prompts x {w.group} samples x <= {w.tokens} tokens, "
        f"{w.updates} updates a step, lr {w.lr}, up to {w.steps} steps or {w.minutes} min a run; held-out: "
        f"{w.eval_prompts} items, greedy. Machine load (1-min average) at the start: {load}.",
        "",
        "| task | trainer | held-out before -> after | steps | step s (median) | peak RSS MB | "
        "reward by step | clip frac (median) | sampler gap (max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task, t in s.items():
        for name in TRAINERS:
            if name in t:
                r = t[name]
                seeds = ", ".join(f"{k}: {v:.2f}" for k, v in r["after_per_seed"].items())
                lines.append(
                    f"| {task} | {name} | {_fmt(t['before'], '.2f')} -> {r['after']:.2f} (seeds {seeds}) | "
                    f"{r['steps_done']} | {_fmt(r['step_s_median'], '.1f')} | {r['peak_rss_mb']:.0f} | "
                    f"{' '.join(f'{x:.2f}' for x in r['reward_curve'])} | {_fmt(r['clip_frac_median'])} | "
                    f"{_fmt(r['logprob_gap_max'], '.1e')} |"
                )
        if "step_ratio_ours_gspo_over_trl" in t:
            lines.append(f"| {task} | ours-gspo / trl step time | {t['step_ratio_ours_gspo_over_trl']:.3f} |||||||")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80)
    for r in runs:
        style = "--" if r["trainer"] == "trl" else "-"
        label = f"{r['trainer']} {r['task']} s{r['seed']}"
        a.plot(range(1, len(r["reward"]) + 1), r["reward"], style, label=label)
        b.plot(range(1, len(r["step_s"]) + 1), r["step_s"], style, label=label)
    a.set(title="mean training reward", xlabel="step")
    b.set(title="step time (s)", xlabel="step")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.real_model", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a Hugging Face model directory, or `smollm2` (bench.smollm2)")
    p.add_argument("--tasks", default="basic_arithmetic,letter_counting", help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--seeds", default="0", help="comma list of trainer seeds (sampling, data order)")
    p.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma list of {', '.join(TRAINERS)}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock cap of each run's training")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--updates", type=int, default=2, help="optimizer updates per step")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument(
        "--micro-batch-tokens", type=int, default=512, help="ours: tokens per forward + backward (0: a mini-batch)"
    )
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out items (the same for every run)")
    p.add_argument(
        "--precision", default="auto", choices=["auto", "fp32", "bf16"], help="ours: the trainer's precision"
    )
    p.add_argument("--engine", default="auto", help="our rollout engine: auto | vllm | transformers")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.one:
        w = RealWorkload(**json.loads(a.workload))
        print(json.dumps({**run_one(a.one, w, Path(a.root), a.engine), "task": w.task, "seed": w.seed}))
        return 0
    tasks, names, seeds = a.tasks.split(","), a.trainers.split(","), [int(x) for x in a.seeds.split(",")]
    if unknown := set(tasks) - set(TASKS):
        p.error(f"--tasks: unknown {sorted(unknown)}; known: {', '.join(TASKS)}")
    if unknown := set(names) - set(TRAINERS):
        p.error(f"--trainers: unknown {sorted(unknown)}; known: {', '.join(TRAINERS)}")
    model_dir = a.model
    if model_dir == "smollm2":
        from bench.smollm2 import smollm2_dir

        model_dir = str(smollm2_dir())
    base = RealWorkload(
        model_dir=str(Path(model_dir).resolve()),
        steps=a.steps,
        minutes=a.minutes,
        prompts=a.prompts,
        group=a.group,
        tokens=a.tokens,
        updates=a.updates,
        lr=a.lr,
        eval_prompts=a.eval_prompts,
        micro_batch_tokens=a.micro_batch_tokens,
        precision=a.precision,
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"real-{time.strftime('%Y%m%d-%H%M%S')}"
    load = f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    root = tempfile.mkdtemp(prefix="gspo-real-bench-")
    runs: list[dict] = []
    before: dict[str, float] = {}
    workloads = {t: RealWorkload(**{**asdict(base), "task": t, "config": TASKS[t]}) for t in tasks}
    try:
        for task, w in workloads.items():
            before[task] = _child("base", w, root, a.engine)["eval"]["accuracy"]
            print(f"{task}: held-out greedy accuracy before {before[task]:.3f}", flush=True)
            for seed in seeds:
                for trainer in names:
                    t0 = time.perf_counter()
                    runs.append(_child(trainer, RealWorkload(**{**asdict(w), "seed": seed}), root, a.engine))
                    r = runs[-1]
                    print(
                        f"{task} seed {seed} {trainer}: {r['steps_done']} steps, after {r['eval']['accuracy']:.3f}, "
                        f"rewards {[round(x, 2) for x in r['reward']]} ({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
                    # Written after every run, so a run cut short by a time limit still leaves its results.
                    (out / f"{tag}.json").write_text(
                        json.dumps(
                            {"workload": asdict(base), "load": load, "summary": summarize(runs, before), "runs": runs},
                            indent=2,
                        )
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    md = markdown(base, summarize(runs, before), load)
    (out / f"{tag}.md").write_text(md + "\n")
    plot(runs, out / f"{tag}.png")
    print(md)
    print(f"results: {out / tag}.json|.md|.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

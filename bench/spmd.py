"""One job at N devices against N = 1, in one run: step time, push time and peak memory of every process.

``python -m bench.spmd [--shape small] [--steps 4] [--engine vllm] [--devices 1 2]``: ``gspo train`` on the
example toy job (``model: toy:<shape>``) at each N in turn, the same seed; while each runs, every process of
its tree is polled for its peak resident memory (``VmHWM``), named by role (trainer rank k, vLLM engine core,
vLLM worker). Steps after the first are timed (the first includes the engines' warm-up). On CPU the point is
correctness and memory per rank, not speed (docs/scaling.md, "vLLM at N > 1").
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _role(pid: int) -> str | None:
    """What a process of the job is, from its command line and environment; None for launchers."""
    try:
        cmd = (Path(f"/proc/{pid}/cmdline").read_bytes()).replace(b"\0", b" ").decode()
        env = dict(
            line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in line
        )
    except (OSError, UnicodeDecodeError):
        return None
    if "gspo_core train" in cmd and "torch.distributed.run" not in cmd:
        return f"trainer rank {env.get('RANK', '0')}"
    if "spawn_main" in cmd:
        return "vLLM process"  # its engine core and TP workers (at N = 1 vLLM runs in the trainer's process)
    return None


def _peak_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_job(shape: str, steps: int, engine: str, devices: int, out_dir: Path) -> dict:
    """The job at ``devices`` ranks: its step times, push times and each process's peak memory (MB)."""
    cmd = [sys.executable, "-m", "gspo_core", "train", str(ROOT / "examples" / "toy_job.yaml")]
    cmd += ["--output-dir", str(out_dir), "--devices", str(devices), "--rollout-engine", engine]
    cmd += ["--set", f"model=toy:{shape}", "--set", f"hyperparameters.steps={steps}"]
    cmd += ["--set", f"hyperparameters.save_every={steps}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // devices))}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, tuple[str, int]] = {}
    while proc.poll() is None:
        for pid in _tree(proc.pid):
            # At N > 1 the command itself only launches torchrun (its ranks are the trainers).
            role = "launcher" if pid == proc.pid and devices > 1 else peaks[pid][0] if pid in peaks else _role(pid)
            if role is not None:
                peaks[pid] = (role, max(_peak_kb(pid), peaks.get(pid, (role, 0))[1]))
        time.sleep(0.5)
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"N = {devices}: gspo train failed:\n{stderr[-3000:]}")
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    timed = metrics[1:] or metrics
    return {
        "devices": devices,
        "wall_s": round(time.perf_counter() - start, 1),
        "step_s_median": statistics.median(m["time/step"] for m in timed),
        "push_s_median": statistics.median(m["time/weight_sync"] for m in timed),
        "sampler_err_max": max(m.get("old_logprobs/sampler_err_max", 0.0) for m in metrics),
        "reward_last": metrics[-1]["reward/mean"],
        "peak_mb": sorted(((role, round(kb / 1024)) for role, kb in peaks.values()), key=str),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="small")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--engine", default="vllm", choices=("vllm", "transformers"))
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for devices in args.devices:
            results.append(run_job(args.shape, args.steps, args.engine, devices, Path(tmp) / f"n{devices}"))
    base = results[0]
    for r in results:
        r["step_over_first"] = round(r["step_s_median"] / base["step_s_median"], 3)
        r["push_frac_of_step"] = round(r["push_s_median"] / r["step_s_median"], 4)
    print(json.dumps({"load_avg_1m": os.getloadavg()[0], "results": results}, indent=1))


if __name__ == "__main__":
    main()

"""The trainer as an SPMD program: two real torchrun ranks over gloo train as one process does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.core.trainer_support import THREAD_ENV, one_torch_thread, toy_spec, train

ROOT = Path(__file__).resolve().parents[2]


def weights(ckpt: str | Path) -> dict:
    return load_file(str(Path(ckpt) / "model" / "model.safetensors"))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_ranks_end_with_the_weights_of_one(tiny_model_dir, tmp_path, lora):
    # 4 mini-batches of 16 rows: each rank trains on its 8 of every one (fp32: the sums differ only in order).
    # (At 10x the rate LoRA's toy run turns chaotic by step 3 and amplifies that rounding past 1e-3.)
    hp = {"steps": 3, "lora_rank": 4 if lora else 0, "learning_rate": 3e-3}
    with one_torch_thread():
        one = train(toy_spec(tiny_model_dir, tmp_path / "one", **hp))
    spec = toy_spec(tiny_model_dir, tmp_path / "two", **hp)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    env = {**os.environ, **THREAD_ENV, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "gspo_core", "train", str(job), "--devices", "2", "--rollout-engine", "transformers"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])  # rank 0 alone reports
    assert result["final_step"] == 3 and result["reward/mean"] == one.metrics["reward/mean"]
    metrics = [json.loads(line) for line in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3], "each step reported once, by rank 0"
    assert metrics[-1]["loss"] == pytest.approx(one.metrics["loss"], abs=1e-6)
    assert metrics[-1]["grad_norm"] == pytest.approx(one.metrics["grad_norm"], rel=1e-4)
    got, want = weights(result["checkpoint"]), weights(one.final_checkpoint)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert got.keys() == want.keys()
    moved = max(float((want[name] - base[name]).abs().max()) for name in want)
    err = max(float((got[name] - want[name]).abs().max()) for name in want)
    assert moved > 1e-3 and err < 1e-5, (moved, err)
    if lora:
        assert (Path(result["checkpoint"]) / "adapter" / "adapter_model.safetensors").is_file()

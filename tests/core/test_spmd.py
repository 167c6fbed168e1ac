"""The trainer as an SPMD program: two real ranks (`gspo train --devices 2`) over gloo train as one process does,
with either engine, and their sharded checkpoint resumes at one rank and loads in transformers and in vLLM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gspo_core.rollout import vllm_available
from tests.core.trainer_support import (
    THREAD_ENV,
    TOY_RUNTIME,
    VLLM_RUNTIME,
    Recorder,
    one_torch_thread,
    processes_running,
    toy_spec,
    train,
)

ROOT = Path(__file__).resolve().parents[2]


def weights(ckpt: str | Path) -> dict:
    return load_file(str(Path(ckpt) / "model" / "model.safetensors"))


# The transformers engine samples with the trainer's gathered weights; vLLM (tensor parallelism over the
# job's 2 devices, its own processes) gets them pushed over gloo after every step: LoRA merged on a dense
# model, and a Qwen3-MoE trained in full. (LoRA with the transformers engine shards as LoRA with vLLM does.)
CASES = [
    pytest.param("transformers", "dense", False, id="full"),
    pytest.param("vllm", "dense", True, id="lora-vllm", marks=[pytest.mark.vllm, pytest.mark.multiprocess]),
    pytest.param("vllm", "moe", False, id="moe-vllm", marks=[pytest.mark.vllm, pytest.mark.multiprocess]),
]


@pytest.mark.parametrize(("engine", "shape", "lora"), CASES)
def test_two_ranks_end_with_the_weights_of_one(tiny_model_dir, tmp_path, engine, shape, lora):
    # 4 mini-batches of 16 rows: each rank trains on its 8 of every one (fp32: the sums differ only in order).
    # (At 10x the rate LoRA's toy run turns chaotic by step 3 and amplifies that rounding past 1e-3.)
    if engine == "vllm" and not vllm_available():
        pytest.skip("vllm not installed")
    model_dir = tiny_model_dir
    if shape == "moe":
        from tests.core.test_weight_transfer import build_tiny_moe

        model_dir = tmp_path / "moe"
        build_tiny_moe(model_dir)
    hp = {"steps": 3, "lora_rank": 4 if lora else 0, "learning_rate": 3e-3, "save_every": 2}
    with one_torch_thread():
        one = train(
            toy_spec(model_dir, tmp_path / "one", **hp), runtime=VLLM_RUNTIME if engine == "vllm" else TOY_RUNTIME
        )
    spec = toy_spec(model_dir, tmp_path / "two", **hp)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    env = {**os.environ, **THREAD_ENV, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "gspo_core", "train", str(job), "--devices", "2", "--rollout-engine", engine]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])  # rank 0 alone reports
    assert result["final_step"] == 3 and result["reward/mean"] == one.metrics["reward/mean"], "the same samples"
    metrics = [json.loads(line) for line in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3], "each step reported once, by rank 0"
    assert metrics[-1]["loss"] == pytest.approx(one.metrics["loss"], abs=1e-6)
    assert metrics[-1]["grad_norm"] == pytest.approx(one.metrics["grad_norm"], rel=1e-4)
    if engine == "vllm":
        # Each step's samples come from the weights the last push sent to both vLLM ranks: their log-probs
        # are the trainer's (fp32), so every push reached every rank whole.
        assert max(m["old_logprobs/sampler_err_max"] for m in metrics) < 1e-5
    got, want = weights(result["checkpoint"]), weights(one.final_checkpoint)
    base = load_file(str(model_dir / "model.safetensors"))
    assert got.keys() == want.keys()
    moved = max(float((want[name] - base[name]).abs().max()) for name in want)
    err = max(float((got[name] - want[name]).abs().max()) for name in want)
    # MoE: AdamW's normalised step magnifies the summation-order rounding of rarely routed experts' small
    # gradients (1.3e-5 measured, against 2.8e-2 moved).
    assert moved > 1e-3 and err < (1e-4 if shape == "moe" else 1e-5), (moved, err)
    if lora:
        assert (Path(result["checkpoint"]) / "adapter" / "adapter_model.safetensors").is_file()
    if engine == "transformers":  # the resumed step samples with the transformers engine (no vLLM start)
        assert_resumes_at_one_rank(tiny_model_dir, tmp_path, hp, Path(spec.output_dir), want)
    assert_loads_in_transformers(Path(result["checkpoint"]), Path(one.final_checkpoint))
    if engine == "vllm" and lora:  # the dense export (LoRA merged) served as it is
        assert_loads_in_vllm(Path(result["checkpoint"]))


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_a_mixtral_of_one_rank_resumes_at_two(tmp_path):
    """A Mixtral (vLLM's loader reads per-expert checkpoint names only) trains with GSPO on vLLM at one rank,
    every step sampling from the weights the last push sent; its step-1 checkpoint resumes at two (DCP
    reshards; vLLM serves with tensor parallelism over both), and steps 2-3 there sample from the weights
    each push sent to both vLLM ranks and end at the one-rank run's weights."""
    if not vllm_available():
        pytest.skip("vllm not installed")
    from tests.core.test_weight_transfer import build_tiny_mixtral

    model_dir = tmp_path / "mixtral"
    build_tiny_mixtral(model_dir, intermediate_size=64)
    hp = {"steps": 3, "learning_rate": 3e-3, "save_every": 1}
    rec = Recorder()
    with one_torch_thread():
        one = train(toy_spec(model_dir, tmp_path / "one", **hp), rec, runtime=VLLM_RUNTIME)
    assert max(m["old_logprobs/sampler_err_max"] for _, m in rec.steps) < 1e-5, "each push reached vLLM whole"
    spec = toy_spec(model_dir, tmp_path / "two", **hp)
    shutil.copytree(Path(one.final_checkpoint).parent, Path(spec.output_dir) / "checkpoints")
    for later in ("step-000002", "step-000003"):
        shutil.rmtree(Path(spec.output_dir) / "checkpoints" / later)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    env = {**os.environ, **THREAD_ENV, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "gspo_core", "train", str(job), "--devices", "2", "--rollout-engine", "vllm"]
    run = subprocess.run([*cmd, "--resume"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    metrics = [json.loads(line) for line in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 3]
    assert max(m["old_logprobs/sampler_err_max"] for m in metrics) < 1e-5
    assert result["reward/mean"] == one.metrics["reward/mean"], "the same samples at one rank and two"
    want = weights(one.final_checkpoint)
    moved = max_error(want, load_file(str(model_dir / "model.safetensors")))
    assert moved > 1e-3 and max_error(weights(result["checkpoint"]), want) < 1e-4


def test_a_killed_rank_ends_the_run_with_its_cause(tiny_model_dir, tmp_path):
    """`gspo train --devices 2` is rank 0 of its job and starts rank 1 (`gspo_core.launch`, as the worker does):
    rank 1 killed mid-run (what the OOM killer does) ends the run at once, exit status 1 naming the cause, and
    no rank outlives it; rank 1's job file holds no reward spec (rank 0 alone scores)."""
    spec = toy_spec(tiny_model_dir, tmp_path / "two", steps=500)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    env = {**os.environ, **THREAD_ENV, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "gspo_core", "train", str(job), "--devices", "2", "--rollout-engine", "transformers"]
    out, ranks = Path(spec.output_dir), str(Path(spec.output_dir) / "ranks.yaml")
    log = tmp_path / "stderr"
    with open(log, "w") as stderr:
        run = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):  # a step trained
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert yaml.safe_load(Path(ranks).read_text())["reward"] == {}
        (rank_1,) = processes_running(ranks)
        os.kill(rank_1, signal.SIGKILL)
        assert run.wait(timeout=60) == 1, log.read_text()[-3000:]
    finally:
        run.kill()
    assert "error: rank 1 was killed (SIGKILL)" in log.read_text()
    assert not processes_running(ranks), "no rank outlives the run"


def max_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def assert_resumes_at_one_rank(tiny_model_dir: Path, tmp_path: Path, hp: dict, two_out: Path, want: dict) -> None:
    """Step 2's checkpoint of the 2-rank run (each rank wrote its shards) resumes in one process: DCP gathers
    each tensor from both ranks' pieces; step 3 then ends where the uninterrupted 1-rank run did."""
    saved = two_out / "checkpoints" / "step-000002"
    assert {p.name for p in (saved / "trainer").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    rec = Recorder()
    with one_torch_thread():
        resumed = train(toy_spec(tiny_model_dir, tmp_path / "resumed", **hp), rec, resume_from=str(saved))
    assert [step for step, _ in rec.steps] == [3]
    assert max_error(weights(resumed.final_checkpoint), want) < 1e-5


def assert_loads_in_transformers(two: Path, one: Path) -> None:
    """The 2-rank run's export is a Hugging Face model that computes what the 1-rank run's does."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        got, want = (AutoModelForCausalLM.from_pretrained(path / "model")(ids).logits for path in (two, one))
    assert torch.allclose(got, want, atol=1e-4)


def assert_loads_in_vllm(two: Path) -> None:
    """The 2-rank run's export is what `vllm.LLM` loads as it is: its log-probs are the export's own."""
    from transformers import AutoModelForCausalLM

    from gspo_core.rollout.vllm_engine import VLLMEngine
    from tests.core.test_weight_transfer import engine_error

    engine = VLLMEngine(str(two / "model"), max_model_len=64, dtype="float32")
    try:
        model = AutoModelForCausalLM.from_pretrained(two / "model").eval()
        assert engine_error(engine, model, [5, 6, 7, 8]) < 1e-5
    finally:
        engine.close()

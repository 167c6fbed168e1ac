"""The GSPO loop for real: it learns (both engines), resumes exactly, checkpoints load, LoRA works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_core.callbacks import Callbacks
from gspo_core.checkpoint import latest_checkpoint
from gspo_core.config import GSPOConfig, JobSpec
from gspo_core.rollout import vllm_available
from gspo_core.toy import TOY_REWARD, write_toy_dataset
from gspo_core.trainer import train

ROOT = Path(__file__).resolve().parents[2]


class Recorder(Callbacks):
    def __init__(self, stop_after: int | None = None) -> None:
        self.steps, self.samples, self.ckpts, self.stop_after = [], [], [], stop_after

    def on_step(self, step, metrics):
        self.steps.append((step, metrics))

    def on_samples(self, step, rows):
        self.samples.append((step, rows))

    def on_checkpoint(self, step, path, final):
        self.ckpts.append((step, path, final))

    def should_stop(self):
        return self.stop_after is not None and len(self.steps) >= self.stop_after


def spec_for(model_dir, tmp_path, **hp) -> JobSpec:
    data = write_toy_dataset(tmp_path / "toy.jsonl", n=64)
    base = dict(steps=6, prompts_per_step=8, group_size=8, max_new_tokens=4, learning_rate=3e-3,
                rollout_engine="transformers")
    return JobSpec(model=str(model_dir), training_file=str(data), reward=TOY_REWARD,
                   hyperparameters=GSPOConfig(**{**base, **hp}), output_dir=str(tmp_path / "out"))


def mean_reward(rec: Recorder, steps) -> float:
    vals = [m["reward/mean"] for s, m in rec.steps if s in steps]
    return sum(vals) / len(vals)


REQUIRED_METRICS = [
    "reward/mean", "reward/std", "reward/match/mean", "reward/frac_zero_std", "clip/low_frac", "clip/high_frac",
    "ratio/mean", "ratio/min", "ratio/max", "loss", "grad_norm", "lr", "entropy", "completion/len_mean",
    "completion/len_max", "completion/truncated_frac", "logprob_gap/mean", "logprob_gap/max",
    "grader_errors/match", "time/rollout", "time/reward", "time/train", "time/weight_sync", "time/step",
    "throughput/tokens_per_s",
]


def test_metrics_samples_and_checkpoint(tiny_model_dir, tmp_path):
    rec = Recorder()
    val = write_toy_dataset(tmp_path / "val.jsonl", n=8, seed=1)
    spec = spec_for(tiny_model_dir, tmp_path, steps=4, eval_every=2, save_every=2)
    spec = spec.model_copy(update={"validation_file": str(val)})
    result = train(spec, rec)
    assert [s for s, _ in rec.steps] == [1, 2, 3, 4]
    for name in REQUIRED_METRICS:
        assert name in rec.steps[-1][1], name
    assert "eval/reward/mean" in rec.steps[1][1] and "eval/reward/mean" not in rec.steps[0][1]
    step, rows = rec.samples[0]
    assert len(rows) == 4 and len(rows[0]["completions"]) == 8
    assert {"text", "reward", "scores", "errors", "tokens", "finish_reason"} <= set(rows[0]["completions"][0])
    assert [(s, f) for s, _, f in rec.ckpts] == [(2, False), (4, True)]
    assert result.final_checkpoint == latest_checkpoint(spec.output_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(result.final_checkpoint) / "model"
    AutoModelForCausalLM.from_pretrained(model_dir)
    AutoTokenizer.from_pretrained(model_dir)


def test_resume_is_exact(tiny_model_dir, tmp_path):
    """Stop after 2 of 4 steps, resume from the checkpoint: same weights as an uninterrupted run."""
    full = train(spec_for(tiny_model_dir, tmp_path / "a", steps=4), Recorder())
    part = spec_for(tiny_model_dir, tmp_path / "b", steps=4)
    stopped = train(part, Recorder(stop_after=2))
    assert stopped.stopped and stopped.final_step == 2
    rec = Recorder()
    resumed = train(part, rec, resume_from=stopped.final_checkpoint)
    assert [s for s, _ in rec.steps] == [3, 4] and not resumed.stopped
    from safetensors.torch import load_file

    a = load_file(Path(full.final_checkpoint) / "model" / "model.safetensors")
    b = load_file(Path(resumed.final_checkpoint) / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_lora_run_saves_adapter_and_merged_model(tiny_model_dir, tmp_path):
    result = train(spec_for(tiny_model_dir, tmp_path, steps=2, lora_rank=4, learning_rate=1e-2), Recorder())
    ckpt = Path(result.final_checkpoint)
    assert (ckpt / "adapter" / "adapter_config.json").exists()
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    diff = (merged.model.layers[0].self_attn.q_proj.weight - base.model.layers[0].self_attn.q_proj.weight).abs().max()
    assert diff > 0, "merged LoRA weights must differ from the base"


@pytest.mark.slow
def test_it_learns_with_transformers_engine(tiny_model_dir, tmp_path):
    rec = Recorder()
    train(spec_for(tiny_model_dir, tmp_path, steps=70), rec)
    first, last = mean_reward(rec, range(1, 6)), mean_reward(rec, range(61, 71))
    print(f"transformers engine: reward {first:.3f} -> {last:.3f}")
    assert first < 0.1 and last > 0.5


@pytest.mark.slow
@pytest.mark.vllm
def test_it_learns_with_vllm_engine_and_checkpoint_loads_in_vllm(tiny_model_dir, tmp_path):
    if not vllm_available():
        pytest.skip("vllm not installed")
    rec = Recorder()
    result = train(spec_for(tiny_model_dir, tmp_path, steps=70, rollout_engine="vllm"), rec)
    first, last = mean_reward(rec, range(1, 6)), mean_reward(rec, range(61, 71))
    print(f"vLLM engine: reward {first:.3f} -> {last:.3f}")
    assert first < 0.1 and last > 0.5
    gaps = [m["logprob_gap/max"] for _, m in rec.steps]
    assert max(gaps) < 1e-3, "the engine must sample with the pushed weights every step"
    code = (
        "from vllm import LLM, SamplingParams; import sys\n"
        f"llm = LLM(model={str(Path(result.final_checkpoint) / 'model')!r}, dtype='float32', enforce_eager=True, max_model_len=256)\n"
        "out = llm.generate(['say b:'], SamplingParams(max_tokens=4, temperature=0))\n"
        "print('VLLM_OUT', repr(out[0].outputs[0].text))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "VLLM_OUT" in proc.stdout, proc.stderr[-2000:]


def test_cli_train_writes_metrics_and_checkpoint(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text((ROOT / "examples" / "toy_job.yaml").read_text())
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_core", "train", str(job), "--output-dir", str(out),
         "--set", "steps=3", "--set", "rollout_engine=transformers", "--set", "save_every=0"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["final_step"] == 3
    assert (out / "checkpoints" / "step-000003" / "model" / "model.safetensors").exists()
    assert "3/3" in proc.stderr  # the progress bar

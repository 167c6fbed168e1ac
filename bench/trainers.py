"""One benchmark run of one trainer (ours or TRL), in the current process; prints a JSON result."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from bench.workload import Workload, prepare, similarity


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(w: Workload, root: Path, engine: str = "auto", old_logprobs: str = "recompute") -> dict:
    from gspo_core.callbacks import Callbacks
    from gspo_core.config import GSPOConfig, JobSpec
    from gspo_core.toy import TOY_REWARD
    from gspo_core.trainer import train

    from gspo_core.rollout import vllm_available

    if engine == "auto":
        engine = "vllm" if vllm_available() else "transformers"
    model, data = prepare(w, root)
    steps: list[dict] = []

    class Rec(Callbacks):
        def on_step(self, step, metrics):
            steps.append(metrics)

    cfg = GSPOConfig(steps=w.steps, prompts_per_step=w.prompts, group_size=w.group, max_new_tokens=w.tokens,
                     ignore_eos=w.fixed_length, mini_batches=w.updates, learning_rate=w.lr, seed=w.seed,
                     rollout_engine=engine, old_logprobs=old_logprobs, samples_per_step=0)
    spec = JobSpec(model=str(model), training_file=str(data), reward=TOY_REWARD, hyperparameters=cfg,
                   output_dir=str(root / "out-ours"))
    t0 = time.perf_counter()
    train(spec, Rec())
    phases = {k[5:]: [m[k] for m in steps] for k in steps[0] if k.startswith("time/")}
    return {"trainer": "ours", "engine": engine, "step_s": phases.pop("step"), "phases": phases,
            "reward": [m["reward/mean"] for m in steps], "wall_s": time.perf_counter() - t0,
            "peak_rss_mb": peak_rss_mb()}


def run_trl(w: Workload, root: Path) -> dict:
    """TRL GRPOTrainer in GSPO mode with HF generate (its vLLM colocate mode does not support vLLM 0.32)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir, data = prepare(w, root)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["prompt"], "target": r["target"]} for r in rows])

    def reward(completions, target, **_):
        return [similarity(c, t) for c, t in zip(completions, target)]

    n = w.prompts * w.group
    args = GRPOConfig(
        output_dir=str(root / "out-trl"), importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4,
        epsilon_high=4e-4, beta=0.0, num_generations=w.group,
        per_device_train_batch_size=n // w.updates, steps_per_generation=w.updates, gradient_accumulation_steps=1,
        max_completion_length=w.tokens, learning_rate=w.lr, max_steps=w.steps * w.updates, use_cpu=True,
        logging_steps=1, save_strategy="no", report_to="none", seed=w.seed, temperature=1.0, top_p=1.0,
        generation_kwargs={"min_new_tokens": w.tokens} if w.fixed_length else None, disable_tqdm=True,
        max_grad_norm=1.0, adam_beta2=0.99, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0)
    marks: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            marks.append(time.perf_counter())

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    # One GSPO step = one generation + `updates` optimizer updates: group the update timestamps.
    ends = [t0] + marks[w.updates - 1::w.updates]
    step_s = [b - a for a, b in zip(ends, ends[1:])]
    per_step_reward = [rewards[i] for i in range(0, len(rewards), w.updates)]
    return {"trainer": "trl", "engine": "transformers", "step_s": step_s, "phases": {},
            "reward": per_step_reward, "wall_s": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}

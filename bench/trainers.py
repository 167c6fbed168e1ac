"""One benchmark run of one trainer (ours or TRL), in the current process; returns a JSON-able result."""

from __future__ import annotations

import functools
import itertools
import json
import resource
import time
from pathlib import Path

from bench.workload import Workload, prepare, similarity


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s() -> float:
    """CPU seconds (user + system) of this process's threads and its waited-for children so far: less
    sensitive than wall time to other work on a shared machine."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_ours(w: Workload, root: Path, engine: str = "auto", **overrides) -> dict:
    """gspo_core.trainer.train on the workload, ``overrides`` of GSPOConfig's defaults applied (and of
    RuntimeOptions' for its fields); phases come from its own ``time/*`` metrics. The run owns its process:
    it prepares it as the worker does (`gspo_core.platform.prepare_process`)."""
    from dataclasses import fields

    from gspo_core.callbacks import Callbacks
    from gspo_core.config import GSPOConfig, JobSpec
    from gspo_core.platform import RuntimeOptions, prepare_process
    from gspo_core.rollout import vllm_available
    from gspo_core.toy import TOY_REWARD
    from gspo_core.trainer import train

    if engine == "auto":
        engine = "vllm" if vllm_available() else "transformers"
    runtime_keys = {f.name for f in fields(RuntimeOptions)}
    runtime = RuntimeOptions(rollout_engine=engine, **{k: v for k, v in overrides.items() if k in runtime_keys})
    prepare_process(runtime)
    model, data = prepare(w, root)
    steps: list[dict] = []
    cpu_marks: list[float] = []
    rss_marks: list[float] = [peak_rss_mb()]  # the peak so far: before train(), then at each step's end

    class Rec(Callbacks):
        def on_step(self, step, metrics):
            steps.append(metrics)
            cpu_marks.append(cpu_s())
            rss_marks.append(peak_rss_mb())

    cfg = GSPOConfig(
        steps=w.steps,
        prompts_per_step=w.prompts,
        group_size=w.group,
        max_new_tokens=w.tokens,
        ignore_eos=w.fixed_length,
        mini_batches=w.updates,
        learning_rate=w.lr,
        seed=w.seed,
        samples_per_step=0,
        **({"micro_batch_tokens": w.micro_batch_tokens} if w.micro_batch_tokens is not None else {}),
        **{k: v for k, v in overrides.items() if k not in runtime_keys},
    )
    spec = JobSpec(
        model=str(model),
        training_file=str(data),
        reward=TOY_REWARD,
        hyperparameters=cfg,
        output_dir=str(root / f"out-ours-{engine}"),
    )
    t0, cpu0 = time.perf_counter(), cpu_s()
    train(spec, Rec(), runtime=runtime)
    phases = {k[5:]: [m[k] for m in steps] for k in steps[0] if k.startswith("time/")}
    return {
        "trainer": "ours",
        "engine": engine,
        "overrides": overrides,
        "step_s": phases.pop("step"),
        "phases": phases,
        "reward": [m["reward/mean"] for m in steps],
        # CPU seconds between step ends (step 1's from the start of train(): model and engine start-up included)
        "step_cpu_s": [b - a for a, b in itertools.pairwise([cpu0, *cpu_marks])],
        "tokens_sampled": [m["tokens/sampled"] for m in steps],
        "wall_s": time.perf_counter() - t0,
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_by_step_mb": rss_marks,  # where the peak was reached: set-up, a step, or the end (checkpoint)
        # the update leaves zero-advantage rows (tied groups) out of mini-batches 2..k: say how many
        "rows_skipped_frac": [m["update/rows_skipped_frac"] for m in steps],
        "tied_groups_frac": [m["reward/frac_zero_std"] for m in steps],
    }


def _timed(obj, name: str, sink: list[float]) -> None:
    """Wrap ``obj.name`` so each call's wall time is appended to ``sink`` (TRL has no phase timers)."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def trl_args(w: Workload, out_dir: Path, engine: str, bf16: bool = False):
    """TRL GRPOConfig in GSPO mode, on the same work as ours: the precision ours picks (fp32 on CPU,
    bf16 autocast on GPU; TRL's bf16 default is emulated and slow on a CPU without bf16 units), or bf16
    autocast where ``bf16`` (the peer of ``precision=bf16``); no gradient checkpointing (TRL's default
    is on, ours off), constant LR, the same AdamW betas, clipping and grad-norm cap."""
    import torch
    from trl import GRPOConfig

    gpu = torch.cuda.is_available()
    n = w.prompts * w.group
    vllm = (
        {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": 512}
        if engine == "vllm"
        else {}
    )
    return GRPOConfig(
        output_dir=str(out_dir),
        importance_sampling_level="sequence",
        loss_type="grpo",
        epsilon=3e-4,
        epsilon_high=4e-4,
        beta=0.0,
        num_generations=w.group,
        per_device_train_batch_size=n // w.updates,
        steps_per_generation=w.updates,
        gradient_accumulation_steps=1,
        max_completion_length=w.tokens,
        learning_rate=w.lr,
        max_steps=w.steps * w.updates,
        use_cpu=not gpu,
        bf16=gpu or bf16,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=w.seed,
        temperature=1.0,
        top_p=1.0,
        generation_kwargs=({"ignore_eos": True} if engine == "vllm" else {"min_new_tokens": w.tokens})
        if w.fixed_length
        else None,
        disable_tqdm=True,
        max_grad_norm=1.0,
        adam_beta2=0.99,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        **vllm,
    )


def run_trl(
    w: Workload, root: Path, engine: str = "transformers", keep_freed_memory: bool = False, bf16: bool = False
) -> dict:
    """TRL GRPOTrainer in GSPO mode; ``engine`` "transformers" (HF generate) or "vllm" (colocate);
    ``keep_freed_memory``: our trainer's heap policy applied to TRL's process too; ``bf16``: bf16 autocast."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    model_dir, data = prepare(w, root)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["prompt"], "target": r["target"]} for r in rows])

    marks: list[float] = []
    rewards: list[float] = []  # mean reward of each generation batch (= of each GSPO step)

    def reward(completions, target, **_):
        scores = [similarity(c, t) for c, t in zip(completions, target, strict=True)]
        rewards.append(sum(scores) / len(scores))
        return scores

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            marks.append(time.perf_counter())

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=trl_args(w, root / "out-trl", engine, bf16),
        train_dataset=ds,
        processing_class=tok,
        callbacks=[Clock()],
    )
    gen: list[float] = []
    rew: list[float] = []
    prep: list[float] = []
    _timed(trainer, "_generate", gen)
    _timed(trainer, "_calculate_rewards", rew)
    _timed(trainer, "_generate_and_score_completions", prep)
    if keep_freed_memory:  # after TRL's model is loaded, before its first step (ours: at process start)
        from gspo_core.platform.heap import keep_freed_memory as keep

        keep()
    t0 = time.perf_counter()
    trainer.train()
    # One GSPO step = one generation + `updates` optimizer updates: group the update timestamps.
    ends = [t0, *marks[w.updates - 1 :: w.updates]]
    step_s = [b - a for a, b in itertools.pairwise(ends)]
    # _generate_and_score_completions = rollout (+ weight push with vLLM) + rewards + old-logprob forward.
    phases = {
        "rollout": gen,
        "reward": rew,
        "old_logprobs": [p - g - r for p, g, r in zip(prep, gen, rew, strict=True)],
        "train": [s - p for s, p in zip(step_s, prep, strict=True)],
    }
    return {
        "trainer": "trl",
        "engine": engine,
        "step_s": step_s,
        "phases": phases,
        "reward": rewards,
        "wall_s": time.perf_counter() - t0,
        "peak_rss_mb": peak_rss_mb(),
    }

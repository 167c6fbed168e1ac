"""Shared helpers of the trainer tests: a recording callbacks object, toy job specs run on the transformers
engine, one torch thread, one step's update, the processes of a job's ranks."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

import gspo_core.trainer
from gspo_core import step as phases
from gspo_core.callbacks import Callbacks
from gspo_core.config import GSPOConfig, JobSpec
from gspo_core.platform import RuntimeOptions
from gspo_core.toy import TOY_REWARD, write_toy_dataset
from gspo_core.trainer import make_optimizer

#: The toy jobs' runtime: the transformers engine (vLLM's start costs seconds a test).
TOY_RUNTIME = RuntimeOptions(rollout_engine="transformers")
VLLM_RUNTIME = RuntimeOptions(rollout_engine="vllm")

# The toy model is tiny: with several torch threads on a busy 2-core machine, thread hand-offs cost
# far more than the arithmetic (measured: 12 steps in 1.6 s with 1 thread, 50 s with 2 under load).
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextlib.contextmanager
def one_torch_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


class Recorder(Callbacks):
    """Keeps everything the trainer reports; ``stop_after`` makes ``should_stop`` fire after N steps."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.steps, self.samples, self.ckpts, self.logs, self.evaluations = [], [], [], [], []
        self.stop_after, self.polls = stop_after, 0

    def on_step(self, step, metrics):
        self.steps.append((step, metrics))

    def on_samples(self, step, rows):
        self.samples.append((step, rows))

    def on_checkpoint(self, step, path, final):
        self.ckpts.append((step, path, final))

    def on_log(self, message):
        self.logs.append(message)

    def on_evaluation(self, evaluation):
        self.evaluations.append(evaluation)

    def should_stop(self):
        self.polls += 1  # step 0 (the evaluation before training) is not a step
        return self.stop_after is not None and len([s for s, _ in self.steps if s]) >= self.stop_after

    def metric(self, name: str) -> list[float]:
        return [metrics[name] for _, metrics in self.steps]


def train(spec: JobSpec, callbacks=None, **kw):
    """`gspo_core.trainer.train` with the toy runtime unless ``runtime`` is given."""
    return gspo_core.trainer.train(spec, callbacks, **{"runtime": TOY_RUNTIME, **kw})


def Trainer(spec: JobSpec, callbacks=None, **kw) -> gspo_core.trainer.Trainer:
    """`gspo_core.trainer.Trainer` with the toy runtime unless ``runtime`` is given."""
    return gspo_core.trainer.Trainer(spec, callbacks, **{"runtime": TOY_RUNTIME, **kw})


def toy_spec(model_dir, tmp_path, **hp) -> JobSpec:
    """The toy task ("say a:" -> "aaaa") on the tiny model (run with `TOY_RUNTIME`: the transformers engine)."""
    data = write_toy_dataset(tmp_path / "toy.jsonl", n=64)
    base = {"steps": 3, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 4, "learning_rate": 3e-3}
    return JobSpec(
        model=str(model_dir),
        training_file=str(data),
        reward=TOY_REWARD,
        hyperparameters=GSPOConfig(**{**base, **hp}),
        output_dir=str(tmp_path / "out"),
    )


#: The update tests' config: 4 prompts x 4 completions of 6 tokens, 4 mini-batches, each one forward (the
#: reference that micro-batched updates are compared with).
UPDATE_CFG = GSPOConfig(group_size=4, max_new_tokens=6, mini_batches=4, learning_rate=1e-2, micro_batch_tokens=0)


def update_step(sampled, cfg: GSPOConfig, logprob_bias: float = 0.0):
    """Advantages, mini-batch plan, old logprobs and update of a fresh copy of the ``sampled`` fixture's
    policy (tests/core/conftest.py) under ``cfg``, the sampler's logprobs off by ``logprob_bias``, as the
    trainer's step runs them; returns ``(view, metrics, model)``. ``view`` holds the step's values by the
    names the tests read: ``completions``, ``batches`` (the plan's), ``old_logp_NT`` (the old logprobs the
    update used), ``verify_sampler``, ``first_batch_on_policy`` and ``recomputed`` (the check failed)."""
    model0, pad_id, comps, rewards_N = sampled
    model = copy.deepcopy(model0)
    comps = [replace(c, logprobs=[lp + logprob_bias for lp in c.logprobs]) for c in comps]
    rollout = phases.Rollout(rows=[{}] * 4, prompts=[""] * 4, completions=comps)
    optimizer, scheduler = make_optimizer(model, cfg)
    policy = phases.PolicyState(model, optimizer, scheduler, None, pad_id)
    adv_N, adv_metrics = phases.advantages(rewards_N, cfg)
    plan = phases.plan_minibatches(rollout, adv_N, cfg, torch.Generator().manual_seed(1))
    old = phases.old_logprobs(policy, rollout, plan, cfg)
    result = phases.update(policy, rollout, old, adv_N, plan, cfg)
    view = SimpleNamespace(
        completions=comps,
        batches=list(plan.batches),
        old_logp_NT=result.old.logp_NT,
        verify_sampler=old.verify,
        first_batch_on_policy=old.first_on_policy,
        recomputed=result.sampler_rejected,
    )
    return view, {**result.metrics, **adv_metrics}, model


def processes_running(arg: str) -> list[int]:
    """Pids of the live processes one of whose arguments is ``arg``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and arg.encode() in (proc / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:  # it ended meanwhile
            continue
    return pids

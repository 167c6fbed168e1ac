"""Shared helpers of the trainer tests: a recording callbacks object, toy job specs, one torch thread."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import torch

from gspo_core import step as S
from gspo_core.callbacks import Callbacks
from gspo_core.config import GSPOConfig, JobSpec
from gspo_core.toy import TOY_REWARD, write_toy_dataset
from gspo_core.trainer import make_optimizer

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
        self.steps, self.samples, self.ckpts, self.logs = [], [], [], []
        self.stop_after, self.polls = stop_after, 0

    def on_step(self, step, metrics):
        self.steps.append((step, metrics))

    def on_samples(self, step, rows):
        self.samples.append((step, rows))

    def on_checkpoint(self, step, path, final):
        self.ckpts.append((step, path, final))

    def on_log(self, message):
        self.logs.append(message)

    def should_stop(self):
        self.polls += 1
        return self.stop_after is not None and len(self.steps) >= self.stop_after

    def metric(self, name: str) -> list[float]:
        return [m[name] for _, m in self.steps]


def toy_spec(model_dir, tmp_path, **hp) -> JobSpec:
    """The toy task ("say a:" -> "aaaa") on the tiny model with the transformers engine."""
    data = write_toy_dataset(tmp_path / "toy.jsonl", n=64)
    base = dict(steps=3, prompts_per_step=8, group_size=8, max_new_tokens=4, learning_rate=3e-3,
                rollout_engine="transformers")
    return JobSpec(model=str(model_dir), training_file=str(data), reward=TOY_REWARD,
                   hyperparameters=GSPOConfig(**{**base, **hp}), output_dir=str(tmp_path / "out"))


#: The update tests' config: 4 prompts x 4 completions of 6 tokens, 4 mini-batches.
UPDATE_CFG = GSPOConfig(group_size=4, max_new_tokens=6, mini_batches=4, learning_rate=1e-2)


def update_step(sampled, cfg: GSPOConfig, logprob_bias: float = 0.0):
    """old_logprobs + update of a fresh copy of the ``sampled`` fixture's policy (tests/core/conftest.py)
    under ``cfg``, the sampler's logprobs off by ``logprob_bias``; returns (rollout, metrics, model)."""
    model0, pad_id, comps, rewards_N = sampled
    model = copy.deepcopy(model0)
    comps = [replace(c, logprobs=[lp + logprob_bias for lp in c.logprobs]) for c in comps]
    ro = S.Rollout(rows=[{}] * 4, prompts=[""] * 4, completions=comps, rewards_N=rewards_N)
    opt, sched = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(1)
    S.old_logprobs(model, ro, pad_id, cfg, None, gen)
    return ro, S.update(model, opt, sched, ro, pad_id, cfg, None, gen), model

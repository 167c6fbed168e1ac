"""bench.workload's GSPO run as a client loop over the primitives, written the way tinker-cookbook's rl/train.py is.

Each step: sample every prompt's group (``SamplingSession.sample_many``: one engine call for all of them, what
the cookbook's concurrent ``sample_async`` calls amount to; ``serial``: one ``sample`` call per prompt), grade,
group-normalised advantages, the rows as ``Datum``s with the sampler's log-probs as the old policy's,
``updates`` mini-batches each one ``forward_backward`` + ``optim_step``, then ``take_weights`` into the sampler.
The loss is ``gspo_token`` with each advantage divided by its mini-batch's rows: the job loop's GSPO update,
value and gradient (tests/core/test_primitives.py checks that equality), so both paths do the same work on the
same data.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.trainers import cpu_s, peak_rss_mb
from bench.workload import Workload, prepare
from gspo_core.primitives import Datum
from gspo_core.step import Timer

if TYPE_CHECKING:
    from gspo_core.config import GSPOConfig
    from gspo_core.primitives import AdamParams, SampledSequence, SamplingParams, SamplingSession, TrainingSession


@dataclass
class Clock:
    """Wall seconds per phase of the current step, and what every step took (wall and CPU)."""

    phases: dict[str, list[float]] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    step_cpu_s: list[float] = field(default_factory=list)

    def record(self, timer: Timer) -> None:
        """A step's phases, as the job loop's own ``Timer`` measured them (``time/<phase>``)."""
        for key, seconds in timer.items():
            self.phases.setdefault(key.removeprefix("time/"), []).append(seconds)


def datums(
    prompts: list[list[int]], groups: list[list[SampledSequence]], adv_N: torch.Tensor, updates: int
) -> list[list[Datum]]:
    """The step's rows as ``updates`` mini-batches of whole groups, in order: each row's positions predict its
    next token; completion positions carry the sampler's log-probs and the advantage over the mini-batch's rows
    (its mean loss); rows of tied groups (advantage 0, no gradient) are left out, as the cookbook drops them."""
    batches: list[list[Datum]] = []
    for part in torch.tensor_split(torch.arange(len(groups)), updates):
        rows = [(p, i) for p in part.tolist() for i in range(len(groups[p]))]
        batch = []
        for p, i in rows:
            seq, adv = groups[p][i], float(adv_N[p * len(groups[p]) + i]) / len(rows)
            if adv == 0:
                continue
            full, pad = prompts[p] + seq.tokens, [0.0] * (len(prompts[p]) - 1)
            ones = [1.0] * len(seq.tokens)
            batch.append(
                Datum(
                    tokens=full[:-1],
                    target_tokens=full[1:],
                    logprobs=pad + list(seq.logprobs),
                    advantages=pad + [adv] * len(seq.tokens),
                    mask=pad + ones,
                )
            )
        batches.append(batch)
    return batches


def run_primitives(w: Workload, root: Path, engine: str = "auto", serial: bool = False) -> dict:
    """The cookbook-style loop on ``w`` in this process (prepared as the job's is); its result, shaped as
    `bench.trainers.run_ours`'s. ``serial``: one sampling call per prompt."""
    from gspo_core.config import GSPOConfig
    from gspo_core.data import render_prompt
    from gspo_core.platform import RuntimeOptions, prepare_process
    from gspo_core.primitives import AdamParams, SamplingParams, SamplingSession, TrainingSession
    from gspo_core.rollout import engine_kind
    from gspo_core.toy import TOY_REWARD

    kind = engine_kind(engine)
    prepare_process(RuntimeOptions(rollout_engine=kind))
    model, data = prepare(w, root)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    cfg = GSPOConfig(learning_rate=w.lr, seed=w.seed)  # the job's defaults: Adam, clipping, shuffling
    t0, cpu0 = time.perf_counter(), cpu_s()
    training = TrainingSession.create(str(model), seed=w.seed)
    tok = training.tokenizer
    prompts = [tok(render_prompt(row, tok), add_special_tokens=False)["input_ids"] for row in rows]
    longest = max(len(p) for p in prompts) + w.tokens
    # The engine sized to the loop's calls (a step's prompts x group, w.tokens each), as the job's is.
    sampler = SamplingSession.create(
        str(model),
        engine=kind,
        seed=w.seed,
        max_model_len=longest,
        max_num_seqs=w.prompts * w.group,
        max_new_tokens=w.tokens,
    )
    loop = Loop(
        w=w,
        cfg=cfg,
        rows=rows,
        prompts=prompts,
        training=training,
        sampler=sampler,
        adam=AdamParams(
            learning_rate=w.lr,
            beta1=cfg.adam_beta1,
            beta2=cfg.adam_beta2,
            eps=1e-8,  # torch's AdamW default, as the job's optimizer
            weight_decay=cfg.weight_decay,
            grad_clip_norm=cfg.max_grad_norm,
        ),
        params=SamplingParams(max_tokens=w.tokens, ignore_eos=w.fixed_length),
        reward_spec=TOY_REWARD,
        serial=serial,
    )
    try:
        clock, rewards, tokens = loop.run(cpu0)
    finally:
        sampler.close()
        training.close()
    return {
        "trainer": "primitives-serial" if serial else "primitives",
        "engine": kind,
        "step_s": clock.step_s,
        "step_cpu_s": clock.step_cpu_s,
        "phases": clock.phases,
        "reward": rewards,
        "tokens_sampled": tokens,
        "wall_s": time.perf_counter() - t0,
        "peak_rss_mb": peak_rss_mb(),
    }


@dataclass
class Loop:
    """What the loop holds: the workload, the job's config (for its defaults), data, sessions and settings."""

    w: Workload
    cfg: GSPOConfig
    rows: list[dict]
    prompts: list[list[int]]
    training: TrainingSession
    sampler: SamplingSession
    adam: AdamParams
    params: SamplingParams
    reward_spec: dict
    serial: bool = False

    def run(self, cpu0: float) -> tuple[Clock, list[float], list[float]]:
        """Every step in order: ``(clock, mean reward per step, tokens sampled per step)``; step 1's CPU
        seconds count from ``cpu0`` (the sessions' start-up, as the job's do)."""
        from dataclasses import replace

        from gspo_core.advantages import group_norm
        from gspo_core.rewards import build_reward
        from gspo_core.schedule import batch_indices

        w, cfg, clock = self.w, self.cfg, Clock()
        bounds = {"clip_low_threshold": 1 - cfg.clip_eps_low, "clip_high_threshold": 1 + cfg.clip_eps_high}
        reward_fn = build_reward(self.reward_spec)
        rewards, tokens = [], []
        try:
            for step in range(1, w.steps + 1):
                start, timer = time.perf_counter(), Timer()
                picked = batch_indices(len(self.rows), step, w.prompts, w.seed, cfg.shuffle)
                prompts = [self.prompts[i] for i in picked]
                with timer.phase("rollout"):
                    params = replace(self.params, seed=w.seed * 100_003 + step)
                    if self.serial:
                        groups = [self.sampler.sample(prompt, w.group, params) for prompt in prompts]
                    else:
                        groups = self.sampler.sample_many(prompts, w.group, params)
                with timer.phase("reward"):
                    items = [self.rows[i] for i in picked for _ in range(w.group)]
                    texts = [
                        self.sampler.tokenizer.decode(s.tokens, skip_special_tokens=True) for g in groups for s in g
                    ]
                    grades = reward_fn.score_batch(items, [{"output_text": text} for text in texts])
                    rewards_N = torch.tensor([grade.reward for grade in grades])
                with timer.phase("advantages"):
                    adv_N, _ = group_norm(rewards_N, w.group)
                    batches = datums(prompts, groups, adv_N, w.updates)
                with timer.phase("train"):
                    for batch in batches:
                        if batch:  # a mini-batch of tied groups only: AdamW still steps, as the job's does
                            self.training.forward_backward(batch, "gspo_token", bounds)
                        self.training.optim_step(self.adam)
                with timer.phase("weight_sync"):
                    self.sampler.take_weights(self.training)
                clock.record(timer)
                clock.step_s.append(time.perf_counter() - start)
                clock.step_cpu_s.append(cpu_s() - cpu0 - sum(clock.step_cpu_s))
                rewards.append(float(rewards_N.mean()))
                tokens.append(float(sum(len(s.tokens) for g in groups for s in g)))
        finally:
            reward_fn.close()
        return clock, rewards, tokens

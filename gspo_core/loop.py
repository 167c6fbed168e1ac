"""The job loop: steps to the last (or a stop), evaluations around them, checkpoints and resume; callbacks
report each. Any job runs it (`Job`): the GSPO trainer's and supervised fine-tuning's, peers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from gspo_core.callbacks import Callbacks, Evaluation
from gspo_core.checkpoint import load_trainer_state, restore, save_checkpoint
from gspo_core.stopping import StepStopped

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.config import GSPOConfig, JobSpec
    from gspo_core.distributed import LeadWriter, Ranks
    from gspo_core.policy import Policy
    from gspo_core.step import PolicyState


class Job(Protocol):
    """What the loop drives (`gspo_core.trainer.Trainer`, `gspo_core.sft.SFTTrainer`): the job's rows, policy,
    callbacks and writer (rank 0's; ones that do nothing on the other ranks: `job_callbacks`,
    `gspo_core.distributed.lead_writer`), the last completed
    ``step`` and the newest checkpoint ``saved`` (step, dir); a step, an evaluation, and whether the next step
    may begin (rank 0's callbacks decide for every rank)."""

    spec: JobSpec
    cfg: GSPOConfig
    rows: list[dict]
    val_rows: list[dict]
    ranks: Ranks
    callbacks: Callbacks
    writer: LeadWriter
    tokenizer: PreTrainedTokenizerBase
    policy: PolicyState
    scheduler: Any
    step: int
    saved: tuple[int, str] | None

    @property
    def model(self) -> Policy: ...

    def begin_step(self) -> bool: ...

    def run_step(self, step: int) -> tuple[dict, list[dict]]: ...

    def evaluate(self) -> dict[str, float]: ...


@dataclass
class TrainResult:
    """How a run ended: the last completed step, its checkpoint, and whether it was asked to stop."""

    final_step: int
    final_checkpoint: str | None
    stopped: bool
    metrics: dict[str, float] = field(default_factory=dict)


def run(trainer: Job) -> TrainResult:
    """Steps to the last (or a stop), with the held-out evaluation before the first step (as step 0's
    metrics), every ``eval_every`` steps, and after the last."""
    cfg = trainer.cfg
    metrics: dict[str, float] = {}
    last_ckpt = trainer.saved[1] if trainer.saved else None
    if trainer.step == 0 and trainer.val_rows:
        try:
            before = evaluate_around(trainer, "before")
        except StepStopped:  # asked to stop before the first step: nothing trained, nothing to compare
            return TrainResult(trainer.step, checkpoint(trainer, final=False), stopped=True, metrics=metrics)
        trainer.callbacks.on_step(0, before)
    while trainer.step < cfg.steps:
        if not trainer.begin_step():
            return TrainResult(trainer.step, checkpoint(trainer, final=False), stopped=True, metrics=metrics)
        step = trainer.step + 1
        try:
            metrics, rows = trainer.run_step(step)
        except StepStopped:  # asked to stop mid-step: its half-done rollout is not trained on
            return TrainResult(trainer.step, checkpoint(trainer, final=False), stopped=True, metrics=metrics)
        trainer.step = step
        stopped = False
        try:
            if trainer.val_rows and step == cfg.steps:
                metrics.update(evaluate_around(trainer, "after"))
            elif cfg.eval_every and trainer.val_rows and step % cfg.eval_every == 0:
                metrics.update(trainer.evaluate())
        except StepStopped:  # the step trained: it is recorded and saved, its evaluation is not
            stopped = True
        trainer.callbacks.on_samples(step, rows)
        trainer.callbacks.on_step(step, metrics)
        if stopped:
            return TrainResult(trainer.step, checkpoint(trainer, final=False), stopped=True, metrics=metrics)
        if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
            last_ckpt = checkpoint(trainer, final=step == cfg.steps)
    return TrainResult(trainer.step, last_ckpt, stopped=False, metrics=metrics)


def evaluate_around(trainer: Job, when: Literal["before", "after"]) -> dict[str, float]:
    """The held-out evaluation before the first step or after the last: its metrics, and its summary
    reported (:meth:`gspo_core.callbacks.Callbacks.on_evaluation`)."""
    metrics = trainer.evaluate()
    prompts = min(len(trainer.val_rows), trainer.cfg.eval_prompts)
    trainer.callbacks.on_evaluation(Evaluation.of(when, trainer.step, prompts, metrics))
    return metrics


def checkpoint(trainer: Job, final: bool) -> str:
    """Save the current step (once: a step already saved is not written again): every rank writes its
    shards of the trainer state, rank 0 the export; the callbacks (rank 0's) report the checkpoint."""
    if trainer.saved is None or trainer.saved[0] != trainer.step:
        path = save_checkpoint(
            trainer.spec.output_dir,
            trainer.step,
            trainer.model,
            trainer.tokenizer,
            trainer.policy.optimizer,
            trainer.scheduler,
            trainer.ranks,
            trainer.writer,
            extra={"data": data_state(trainer)},
        )
        trainer.callbacks.on_checkpoint(trainer.step, str(path), final)
        trainer.saved = (trainer.step, str(path))
    elif final:
        trainer.callbacks.on_checkpoint(trainer.step, trainer.saved[1], final)
    return trainer.saved[1]


def data_state(job: Job) -> dict:
    """The data cursor: batches are a pure function of (rows, seed, step), so this pins them."""
    cfg = job.cfg
    return {"rows": len(job.rows), "seed": cfg.seed, "shuffle": cfg.shuffle, "cursor": job.step * cfg.prompts_per_step}


def resume(job: Job, ckpt_dir: str) -> None:
    """The job's policy, optimizer, schedule and step from a checkpoint; a warning when its data differ (the
    remaining batches then differ from an uninterrupted run's)."""
    state = load_trainer_state(ckpt_dir)
    job.step = restore(job.model, job.policy.optimizer, job.scheduler, state, ckpt_dir, job.ranks)
    job.saved = (job.step, str(ckpt_dir))
    data = state.get("data", {})
    if data and (data.get("rows"), data.get("seed")) != (len(job.rows), job.cfg.seed):
        log(
            job,
            f"warning: the checkpoint was trained on {data.get('rows')} rows with seed "
            f"{data.get('seed')}; this run has {len(job.rows)} rows and seed {job.cfg.seed}, "
            "so the remaining batches differ from an uninterrupted run",
        )


def resumed(job: Job, ckpt_dir: str) -> None:
    """Report the resume (once the job's weights are where it samples them)."""
    log(job, f"resumed from {Path(ckpt_dir).name} (step {job.step})")


def log(job: Job, message: str) -> None:
    """A message to the job's callbacks."""
    job.callbacks.on_log(message)


def job_callbacks(ranks: Ranks, callbacks: Callbacks | None) -> Callbacks:
    """The callbacks a job reports to: the given ones on rank 0, which reports for every rank; callbacks that
    do nothing on the other ranks, so the loop calls them alike on every rank."""
    return ranks.lead(lambda: callbacks) or Callbacks()

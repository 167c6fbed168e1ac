"""The job loop: steps to the last (or a stop), evaluations around them, checkpoints; callbacks report each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from gspo_core.callbacks import Evaluation
from gspo_core.checkpoint import save_checkpoint
from gspo_core.stopping import StepStopped

if TYPE_CHECKING:
    from gspo_core.trainer import Trainer


@dataclass
class TrainResult:
    """How a run ended: the last completed step, its checkpoint, and whether it was asked to stop."""

    final_step: int
    final_checkpoint: str | None
    stopped: bool
    metrics: dict[str, float] = field(default_factory=dict)


def run(trainer: Trainer) -> TrainResult:
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
        if trainer.ranks.main:
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
        if trainer.ranks.main:
            trainer.callbacks.on_samples(step, rows)
            trainer.callbacks.on_step(step, metrics)
        if stopped:
            return TrainResult(trainer.step, checkpoint(trainer, final=False), stopped=True, metrics=metrics)
        if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
            last_ckpt = checkpoint(trainer, final=step == cfg.steps)
    return TrainResult(trainer.step, last_ckpt, stopped=False, metrics=metrics)


def evaluate_around(trainer: Trainer, when: Literal["before", "after"]) -> dict[str, float]:
    """The held-out evaluation before the first step or after the last: its metrics, and its summary
    reported (:meth:`gspo_core.callbacks.Callbacks.on_evaluation`)."""
    metrics = trainer.evaluate()
    if trainer.ranks.main:
        prompts = min(len(trainer.val_rows), trainer.cfg.eval_prompts)
        trainer.callbacks.on_evaluation(Evaluation.of(when, trainer.step, prompts, metrics))
    return metrics


def checkpoint(trainer: Trainer, final: bool) -> str:
    """Save the current step (once: a step already saved is not written again): every rank writes its
    shards of the trainer state, rank 0 the export; rank 0 reports the checkpoint."""
    if trainer.saved is None or trainer.saved[0] != trainer.step:
        path = save_checkpoint(
            trainer.spec.output_dir,
            trainer.step,
            trainer.model,
            trainer.tokenizer,
            trainer.policy.optimizer,
            trainer.scheduler,
            trainer.ranks,
            extra={"data": trainer.data_state()},
        )
        if trainer.ranks.main:
            trainer.callbacks.on_checkpoint(trainer.step, str(path), final)
        trainer.saved = (trainer.step, str(path))
    elif final and trainer.ranks.main:
        trainer.callbacks.on_checkpoint(trainer.step, trainer.saved[1], final)
    return trainer.saved[1]

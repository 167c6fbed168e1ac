"""Checkpoint retention: a job keeps its newest checkpoint and its best k by validation; the others' rows go,
their objects recorded as pending deletions in the same transaction (the caller removes them after commit)."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from store import jobs
from store.models import Checkpoint, Job, PendingDeletion
from store.objects import ObjectStore

#: Checkpoints kept besides the newest when a job's hyperparameters do not say (OpenAI keeps 3).
DEFAULT_KEEP_BEST = 3


def validation_score(metrics: dict) -> float | None:
    """Higher is better: a reinforcement evaluation's mean reward, or a supervised one's negated loss; None
    for a step without an evaluation."""
    if "eval/reward/mean" in metrics:
        return float(metrics["eval/reward/mean"])
    if "eval/loss" in metrics:
        return -float(metrics["eval/loss"])
    return None


def outside_retention(checkpoints: list[Checkpoint], keep_best: int) -> list[Checkpoint]:
    """The checkpoints neither newest nor among the ``keep_best`` best of the others by :func:`validation_score`
    (evaluated ones first, best first; ties and unevaluated ones newest first)."""
    if not checkpoints:
        return []
    newest = max(checkpoints, key=lambda c: c.step)

    def rank(c: Checkpoint) -> tuple[bool, float, int]:
        score = validation_score(c.metrics or {})
        return score is not None, score if score is not None else 0.0, c.step

    best = sorted((c for c in checkpoints if c is not newest), key=rank, reverse=True)[:keep_best]
    kept = {newest.id, *(c.id for c in best)}
    return [c for c in checkpoints if c.id not in kept]


def prune(s: Session, job: Job) -> list[str]:
    """Delete the rows of ``job``'s checkpoints outside its retention (``keep_best_checkpoints``), except those an
    active job trains from (``model: ckpt:<id>``); returns their object prefixes, recorded as pending deletions."""
    keep_best = int(job.hyperparameters.get("keep_best_checkpoints", DEFAULT_KEEP_BEST))
    drop = outside_retention(list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id))), keep_best)
    if drop:
        refs = [f"ckpt:{c.id}" for c in drop]
        used = set(s.scalars(select(Job.model).where(Job.model.in_(refs), Job.status.in_(jobs.ACTIVE))))
        drop = [c for c in drop if f"ckpt:{c.id}" not in used]
    if not drop:
        return []
    s.execute(delete(Checkpoint).where(Checkpoint.id.in_([c.id for c in drop])))
    s.add_all(PendingDeletion(prefix=c.object_prefix) for c in drop)
    steps = ", ".join(str(c.step) for c in sorted(drop, key=lambda c: c.step))
    jobs.add_event(s, job.id, "log", f"checkpoint retention: deleted the checkpoint(s) of step {steps}")
    return [c.object_prefix for c in drop]


def remove_objects(s: Session, objects: ObjectStore, prefixes: list[str]) -> None:
    """Delete the objects of committed pending deletions and then their records; one that fails stays
    recorded (the API's purge retries it)."""
    for prefix in prefixes:
        objects.delete_prefix(prefix)
        s.execute(delete(PendingDeletion).where(PendingDeletion.prefix == prefix))

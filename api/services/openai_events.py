"""A job's events and checkpoints in OpenAI's shapes: status/log/checkpoint rows as ``message`` events and each
step's metrics as a ``metrics`` event with reinforcement fine-tuning's keys; newest first, ``after`` a cursor."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.openai_schemas import FineTuningJobCheckpoint, FineTuningJobEvent, ListOut
from api.schemas import as_utc
from store.models import Checkpoint, Job, JobEvent, StepMetric

#: Rows read past a page so that rows sharing the cursor's timestamp are not cut off.
SLACK = 32
STATUS_MESSAGES = {
    "queued": "Validated the files; the job is queued",
    "running": "Fine-tuning job started",
    "cancelling": "Cancelling the job: it stops within a step",
    "pausing": "Pausing the job: it checkpoints and stops at its next step",
    "paused": "The job was paused; resume it to continue from its checkpoint",
    "succeeded": "The job has successfully completed",
    "cancelled": "The job was cancelled",
}
Key = tuple[datetime, int, int]  # (created_at, 0 for a step's metrics | 1 for an event, step | event id)


def rft_metrics(step: int, total_steps: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """Reinforcement fine-tuning's metric keys from a step's metrics (the trainer's names: gspo_core/step.py)."""
    scores = {
        k[7:-5]: v for k, v in metrics.items() if k.startswith("reward/") and k.endswith("/mean") and k != "reward/mean"
    }
    out: dict[str, Any] = {
        "step": step,
        "total_steps": total_steps,
        "train_mean_reward": metrics.get("reward/mean"),
        "scores": scores,
        "errors": {k[14:]: v for k, v in metrics.items() if k.startswith("grader_errors/")},
        "timing": {k[5:]: v for k, v in metrics.items() if k.startswith("time/")},
        "usage": {"tokens_sampled": metrics.get("tokens/sampled"), "tokens_trained": metrics.get("tokens/trained")},
    }
    if "eval/reward/mean" in metrics:
        out["full_valid_mean_reward"] = metrics["eval/reward/mean"]
    if "eval/greedy/reward/mean" in metrics:  # ours: the greedy completions' mean reward (greedy accuracy)
        out["full_valid_greedy_mean_reward"] = metrics["eval/greedy/reward/mean"]
    return out


def sft_metrics(step: int, total_steps: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """Supervised fine-tuning's metric keys from a supervised step's metrics (gspo_core/sft.py's names)."""
    out: dict[str, Any] = {
        "step": step,
        "total_steps": total_steps,
        "train_loss": metrics.get("loss"),
        "timing": {k[5:]: v for k, v in metrics.items() if k.startswith("time/")},
        "usage": {"tokens_trained": metrics.get("tokens/trained")},
    }
    if "eval/loss" in metrics:
        out["full_valid_loss"] = metrics["eval/loss"]
    return out


def openai_metrics(step: int, total_steps: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """A step's metrics in OpenAI's keys: a reinforcement step has a mean reward, a supervised one only a loss."""
    if "reward/mean" not in metrics and "loss" in metrics:
        return sft_metrics(step, total_steps, metrics)
    return rft_metrics(step, total_steps, metrics)


def _message_event(e: JobEvent) -> FineTuningJobEvent:
    data = e.data or {}
    level: Any = "info"
    message = e.message
    if e.kind == "status":
        status = data.get("status")
        message = STATUS_MESSAGES.get(str(status), message) if not data.get("error") else e.message
        level = "error" if status == "failed" else "info"
    elif "expired" in e.message or "lost" in e.message:
        level = "warn"
    return FineTuningJobEvent(
        id=f"ftevent-e{e.id}",
        created_at=int(as_utc(e.created_at).timestamp()),
        level=level,
        message=message,
        type="message",
        data={"kind": e.kind, **data},
    )


def _metrics_event(step: int, total: int, metrics: dict[str, Any], created_at: datetime) -> FineTuningJobEvent:
    data = openai_metrics(step, total, metrics)
    key = "train_loss" if "train_loss" in data else "train_mean_reward"
    value = data[key]
    shown = f", {key}={value:.4f}" if isinstance(value, (int, float)) else ""
    # Step 0 is the held-out evaluation before training (its before → after is the job log's message event).
    message = "Held-out evaluation before training" if step == 0 else f"Step {step}/{total}{shown}"
    for name in ("full_valid_greedy_mean_reward", "full_valid_mean_reward", "full_valid_loss"):
        if isinstance(data.get(name), (int, float)):
            message += f", {name}={data[name]:.4f}"
    return FineTuningJobEvent(
        id=f"ftevent-m{step}",
        created_at=int(as_utc(created_at).timestamp()),
        level="info",
        message=message,
        type="metrics",
        data=data,
    )


def _cursor(s: Session, job: Job, after: str) -> tuple[Key, datetime]:
    """The sort key of the event ``after`` names, and its stored timestamp; 400 naming ``after`` otherwise."""
    kind, number = after.removeprefix("ftevent-")[:1], after.removeprefix("ftevent-")[1:]
    created = None
    if number.isdigit() and len(number) <= 18 and kind in ("e", "m"):
        if kind == "e":
            created = s.scalar(select(JobEvent.created_at).where(JobEvent.job_id == job.id, JobEvent.id == int(number)))
        else:
            created = s.scalar(
                select(StepMetric.created_at).where(StepMetric.job_id == job.id, StepMetric.step == int(number))
            )
    if created is None:
        raise ApiError(400, "invalid_cursor", f"after: {after!r} is not an event of job {job.id}", "after")
    return (as_utc(created), 1 if kind == "e" else 0, int(number)), created


def list_events(s: Session, job: Job, after: str | None, limit: int) -> ListOut[FineTuningJobEvent]:
    """Newest first; ``after``: the last event id of the previous page."""
    events_q = select(JobEvent).where(JobEvent.job_id == job.id)
    metrics_q = select(StepMetric.step, StepMetric.metrics, StepMetric.created_at).where(StepMetric.job_id == job.id)
    bound: Key | None = None
    if after:
        bound, stored = _cursor(s, job, after)
        events_q = events_q.where(JobEvent.created_at <= stored)
        metrics_q = metrics_q.where(StepMetric.created_at <= stored)
    n = limit + 1 + SLACK
    found: list[tuple[Key, Callable[[], FineTuningJobEvent]]] = []
    for e in s.scalars(events_q.order_by(JobEvent.created_at.desc(), JobEvent.id.desc()).limit(n)):
        found.append(((as_utc(e.created_at), 1, e.id), partial(_message_event, e)))
    for r in s.execute(metrics_q.order_by(StepMetric.created_at.desc(), StepMetric.step.desc()).limit(n)):
        make = partial(_metrics_event, r.step, job.total_steps, r.metrics, r.created_at)
        found.append(((as_utc(r.created_at), 0, r.step), make))
    found = sorted((f for f in found if bound is None or f[0] < bound), key=lambda f: f[0], reverse=True)
    data = [make() for _, make in found[:limit]]
    return ListOut[FineTuningJobEvent](data=data, has_more=len(found) > limit)


def checkpoint_object(c: Checkpoint, total_steps: int, download_url: str) -> FineTuningJobCheckpoint:
    metrics = openai_metrics(c.step, total_steps, c.metrics or {})
    return FineTuningJobCheckpoint(
        id=c.id,
        created_at=int(as_utc(c.created_at).timestamp()),
        fine_tuned_model_checkpoint=f"ckpt:{c.id}",
        fine_tuning_job_id=c.job_id,
        step_number=c.step,
        metrics={k: v for k, v in metrics.items() if k != "total_steps"},
        download_url=download_url,
    )


def list_checkpoints(
    s: Session, job: Job, after: str | None, limit: int, download_url: Callable[[str], str]
) -> ListOut[FineTuningJobCheckpoint]:
    """Newest (highest step) first; ``after``: the last checkpoint id of the previous page."""
    q = select(Checkpoint).where(Checkpoint.job_id == job.id)
    if after:
        step = s.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job.id, Checkpoint.id == after))
        if step is None:
            raise ApiError(400, "invalid_cursor", f"after: {after!r} is not a checkpoint of job {job.id}", "after")
        q = q.where(Checkpoint.step < step)
    rows = list(s.scalars(q.order_by(Checkpoint.step.desc()).limit(limit + 1)))
    data = [checkpoint_object(c, job.total_steps, download_url(c.id)) for c in rows[:limit]]
    return ListOut[FineTuningJobCheckpoint](
        data=data,
        has_more=len(rows) > limit,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )

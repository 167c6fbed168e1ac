"""Jobs at the API: creation (its checks: `api.services.job_checks`), listing, cancelling, pausing and resuming."""

from __future__ import annotations

import base64
import logging
from datetime import datetime
from typing import cast

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.job_schemas import JobCreate, JobEvaluation, JobOut, JobStatus, JobUsage
from api.schemas import Page
from api.services.environments import check_environment_job
from api.services.files import check_room_for_a_job
from api.services.job_checks import (
    check_hyperparameters,
    check_model,
    check_resources,
    check_reward,
    check_supervised,
    check_tools,
    check_wall_limit,
    owned_file,
)
from gspo_core.config import RETIRED_FIELDS, GSPOConfig, Resources
from gspo_core.environments import default_reward, environment_item_fields
from gspo_core.rewards import redact_secrets
from store import jobs as job_state
from store import results
from store.models import Job, JobEvent, Tenant
from store.objects import ObjectStore
from store.queue import enqueue_run_job
from store.scheduling import TenantQueue
from store.settings import Settings
from store.usage import QueuePolicy

log = logging.getLogger(__name__)


def create_job(
    s: Session, settings: Settings, tenant: Tenant, req: JobCreate, idem_key: str | None, objects: ObjectStore
) -> tuple[JobOut, bool]:
    """Validate everything, insert the job, commit, enqueue it. Returns (the job, created): a request
    repeated with its Idempotency-Key answers with the job the first one created."""
    job, created = create_row(s, settings, tenant, req, idem_key, objects)
    return to_out(s, settings, job), created


def create_row(
    s: Session, settings: Settings, tenant: Tenant, req: JobCreate, idem_key: str | None, objects: ObjectStore
) -> tuple[Job, bool]:
    """``(job, created)``: the new job, committed and enqueued, or the one this Idempotency-Key made."""
    cfg = check_hyperparameters(req.hyperparameters)
    if idem_key and (prior := _prior(s, tenant, idem_key)) is not None:
        return _replayed(prior, req, cfg), False
    env, reward = check_environment_job(req, cfg, settings)
    train = owned_file(s, tenant, req.training_file, "training_file") if req.training_file else None
    val = owned_file(s, tenant, req.validation_file, "validation_file") if req.validation_file else None
    if cfg.method == "supervised":
        check_supervised(reward, objects, {"training_file": train, "validation_file": val})
    elif reward is None:
        raise ApiError(
            422, "invalid_reward", "reward: required (a grader spec) unless the method is supervised", "reward"
        )
    else:
        fields = environment_item_fields(env) if env is not None else set(train.item_fields) if train else set()
        check_reward(reward, fields, settings)
    check_tools(req.tools, settings, objects, {"training_file": train, "validation_file": val})
    check_model(s, settings, tenant, req.model)
    check_wall_limit(req.max_wall_seconds, settings)
    check_resources(req.resources, settings)
    check_room_for_a_job(s, settings, tenant.id)
    try:
        job = job_state.create_job(
            s,
            tenant_id=tenant.id,
            name=req.name,
            model=req.model,
            training_file_id=train.id if train else None,
            validation_file_id=req.validation_file,
            environment=req.environment,
            reward=reward or {},
            tools=req.tools,
            metadata=req.metadata,
            seed=req.seed,
            hyperparameters=cfg.model_dump(mode="json", exclude={"seed"}),
            total_steps=cfg.steps,
            idempotency_key=idem_key,
            max_attempts=settings.max_attempts,
            max_wall_seconds=req.max_wall_seconds,
            max_active=settings.max_active_jobs_per_tenant,
            devices=req.resources.devices,
        )
    except job_state.TooManyActiveJobs as exc:
        s.rollback()  # releases the tenant's lock at once
        raise ApiError(
            429,
            "too_many_jobs",
            f"at most {exc.limit} queued or running jobs per tenant "
            "(GSPO_MAX_ACTIVE_JOBS_PER_TENANT); wait for one to finish or cancel one",
        ) from None
    except IntegrityError:  # a concurrent retry with the same Idempotency-Key won the race
        s.rollback()
        if idem_key is None or (prior := _prior(s, tenant, idem_key)) is None:  # else a file deleted meanwhile
            raise ApiError(
                404, "not_found", "a file of this job was deleted while it was being created", "training_file"
            ) from None
        return _replayed(prior, req, cfg), False
    s.commit()
    try:
        enqueue_run_job(settings, job.id)
    except Exception as exc:
        _discard(s, job)
        raise ApiError(
            503,
            "broker_unavailable",
            f"the job queue is unreachable ({type(exc).__name__}); nothing was created, retry shortly",
            headers={"Retry-After": "5"},
        ) from None
    return job, True


def _prior(s: Session, tenant: Tenant, idem_key: str) -> Job | None:
    return s.scalar(select(Job).where(Job.tenant_id == tenant.id, Job.idempotency_key == idem_key))


def _replayed(prior: Job, req: JobCreate, cfg: GSPOConfig) -> Job:
    """The job an earlier request with this Idempotency-Key created, if this request is the same one:
    a key reused for a different job would otherwise silently answer with a job the caller did not ask for."""
    asked = (
        req.model,
        req.training_file,
        req.validation_file,
        req.environment,
        req.reward or (default_reward(req.environment.get("type")) if req.environment else {}),
        req.tools,
        req.name,
        req.metadata,
        req.seed,
        cfg.model_dump(mode="json", exclude={"seed"}),
        req.max_wall_seconds,
        req.resources.devices,
    )
    stored = {k: v for k, v in prior.hyperparameters.items() if k not in RETIRED_FIELDS}  # an earlier version's keys
    made = (
        prior.model,
        prior.training_file_id,
        prior.validation_file_id,
        prior.environment,
        prior.reward,
        prior.tools or [],
        prior.name,
        prior.job_metadata or {},
        prior.seed,
        stored,
        prior.max_wall_seconds,
        prior.devices,
    )
    if asked != made:
        raise ApiError(
            422,
            "idempotency_key_reused",
            f"Idempotency-Key was already used for job {prior.id} with "
            "a different request; use a new key for a different job",
            "Idempotency-Key",
        )
    return prior


def _discard(s: Session, job: Job) -> None:
    """Remove a job that could not be enqueued: no worker would ever see it, so it must not linger."""
    s.execute(delete(JobEvent).where(JobEvent.job_id == job.id))
    s.delete(job)
    s.commit()


def queue_view(s: Session, settings: Settings, tenant_id: str) -> TenantQueue:
    """The tenant's queue, read once per request however many of its jobs are shown."""
    return TenantQueue(s, QueuePolicy.of(settings), tenant_id, settings.worker_devices)


def cancel_job(s: Session, settings: Settings, objects: ObjectStore, job: Job) -> JobOut:
    """Queued and paused jobs are cancelled at once (their results file written); running ones go to
    ``cancelling`` (the worker stops within seconds)."""
    job_state.request_cancel(s, job)
    results.attach(s, objects, job, settling=True)  # before the commit: never seen ended without its file
    s.commit()
    return to_out(s, settings, job)


def _status_error(job: Job, action: str, exc: job_state.IllegalTransition) -> ApiError:
    return ApiError(409, "invalid_status", f"job {job.id} is {job.status}: it cannot be {action} ({exc})", "status")


def pause_job(s: Session, settings: Settings, job: Job) -> JobOut:
    """A queued job pauses at once; a running one goes to ``pausing`` (it checkpoints at its next step and
    stops, freeing its worker); a pausing or paused one is unchanged. 409 for a finished or cancelling job."""
    try:
        job_state.request_pause(s, job)
    except job_state.IllegalTransition as exc:
        raise _status_error(job, "paused", exc) from None
    s.commit()
    return to_out(s, settings, job)


def resume_job(s: Session, settings: Settings, job: Job) -> JobOut:
    """A paused job is queued again (it continues from its latest checkpoint, within the tenant's cap of
    active jobs: 429); a pausing one runs on; a queued or running one is unchanged."""
    try:
        queued = job_state.request_resume(s, job, settings.max_active_jobs_per_tenant)
    except job_state.IllegalTransition as exc:
        raise _status_error(job, "resumed", exc) from None
    except job_state.TooManyActiveJobs as exc:
        s.rollback()
        raise ApiError(
            429,
            "too_many_jobs",
            f"at most {exc.limit} queued or running jobs per tenant (GSPO_MAX_ACTIVE_JOBS_PER_TENANT); "
            f"job {job.id} stays paused: wait for one to finish or cancel one",
        ) from None
    s.commit()
    if queued:
        try:
            enqueue_run_job(settings, job.id)
        except Exception as exc:  # queued in the database: the reaper sends its token again
            log.warning("could not publish the resumed job %s (%s); the reaper will send it again", job.id, exc)
    return to_out(s, settings, job)


def to_out(s: Session, settings: Settings, job: Job, queue: TenantQueue | None = None) -> JobOut:
    waiting = None
    if job.status == "queued":
        waiting = (queue or queue_view(s, settings, job.tenant_id)).waiting(job)
    return JobOut(
        id=job.id,
        name=job.name,
        model=job.model,
        status=cast(JobStatus, job.status),  # the column holds only the statuses store.jobs moves between
        step=job.step,
        total_steps=job.total_steps,
        queue_position=waiting.position if waiting else None,
        waiting_reason=waiting.reason if waiting else None,
        error=job.error,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        training_file=job.training_file_id,
        validation_file=job.validation_file_id,
        environment=redact_secrets(job.environment),
        reward=redact_secrets(job.reward),
        tools=redact_secrets(job.tools or []),
        hyperparameters={**job.hyperparameters, "seed": job.seed},
        metadata=job.job_metadata or {},
        seed=job.seed,
        attempts=job.attempts,
        max_wall_seconds=job.max_wall_seconds,
        resources=Resources(devices=job.devices),
        usage=JobUsage(
            device_seconds=job.device_seconds or 0.0,
            tokens_sampled=job.tokens_sampled or 0,
            tokens_trained=job.tokens_trained or 0,
        ),
        latest_metrics=job.latest_metrics,
        evaluation=JobEvaluation.model_validate(job.evaluation or {}),
    )


def encode_cursor(created_at: datetime, job_id: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{job_id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        ts, job_id = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        return datetime.fromisoformat(ts), job_id
    except Exception:
        raise ApiError(400, "invalid_cursor", "cursor is not one this API returned", "cursor") from None


def list_jobs(
    s: Session, settings: Settings, tenant: Tenant, status: JobStatus | None, limit: int, cursor: str | None
) -> Page[JobOut]:
    """Newest first; the cursor is the last row's (created_at, id)."""
    q = select(Job).where(Job.tenant_id == tenant.id)
    if status:
        q = q.where(Job.status == status)
    if cursor:
        ts, jid = decode_cursor(cursor)
        q = q.where((Job.created_at < ts) | ((Job.created_at == ts) & (Job.id < jid)))
    rows = list(s.scalars(q.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)))
    nxt = encode_cursor(rows[limit - 1].created_at, rows[limit - 1].id) if len(rows) > limit else None
    queue = queue_view(s, settings, tenant.id)
    return Page[JobOut](data=[to_out(s, settings, j, queue) for j in rows[:limit]], next_cursor=nxt)

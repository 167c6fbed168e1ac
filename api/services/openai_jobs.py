"""OpenAI's fine-tuning jobs over this service's jobs: a create translated to a native job (api/services/jobs.py
does every check and the insert), and any job, however made, shown as OpenAI's ``fine_tuning.job``."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.job_schemas import JobCreate
from api.openai_schemas import FineTuningJob, FineTuningJobCreate, FineTuningJobError, ListOut, OpenAIStatus
from api.schemas import as_utc
from api.services import jobs as native
from api.services.openai_hparams import field_param, from_native, to_native
from gspo_core.rewards import redact_secrets
from store import results
from store.models import Checkpoint, File, Job, Tenant
from store.objects import ObjectStore
from store.settings import Settings

STATUS: dict[str, OpenAIStatus] = {
    "queued": "queued",
    "running": "running",
    "cancelling": "cancelled",  # OpenAI's cancel answers cancelled; the worker stops within seconds
    "pausing": "paused",  # OpenAI's pause answers paused; the worker stops within seconds and checkpoints
    "paused": "paused",
    "succeeded": "succeeded",
    "failed": "failed",
    "cancelled": "cancelled",
}
NOT_BUILT = {
    "dpo": "DPO is not built here (see docs/openai.md); use method.type 'reinforcement' or 'supervised'",
}


def unix(value: datetime | None) -> int | None:
    return int(as_utc(value).timestamp()) if value is not None else None


def _http_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Agent RFT's ``{name, server_url, headers, ...}`` tools as native http tools (checked by the native service)."""
    return [{**tool, "type": "http"} for tool in tools or []]


def _openai_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A job's tool in Agent RFT's shape: an http tool without its type (OpenAI's tools are http endpoints);
    any other kind (mcp, agent, python) keeps it, so the view says what the job runs."""
    return {k: v for k, v in tool.items() if k != "type"} if tool.get("type") == "http" else tool


def _check_method(req: FineTuningJobCreate) -> tuple[str, dict[str, Any] | None, dict[str, Any]]:
    """``(method type, grader or None, hyperparameters)``; 400 naming what this service does not do."""
    method = req.method
    kind = method.type if method else "supervised"  # OpenAI's default method
    if kind in NOT_BUILT:
        raise ApiError(400, "unsupported_method", NOT_BUILT[kind], "method.type")
    if kind not in ("reinforcement", "supervised"):
        raise ApiError(400, "invalid_request", f"method.type: unknown method {kind!r}", "method.type")
    if req.hyperparameters:
        raise ApiError(
            400, "invalid_request", f"hyperparameters: give them in method.{kind}.hyperparameters", "hyperparameters"
        )
    if req.integrations:
        raise ApiError(400, "invalid_request", "integrations: none are built here", "integrations")
    if kind == "supervised":
        supervised = method.supervised if method else None
        return kind, None, supervised.hyperparameters if supervised else {}
    if method is None or method.reinforcement is None:
        raise ApiError(
            400, "invalid_request", "method.reinforcement: required for reinforcement", "method.reinforcement"
        )
    hp = method.reinforcement.hyperparameters
    if method.reinforcement.response_format is not None:
        hp = {**hp, "response_format": method.reinforcement.response_format}
    return kind, method.reinforcement.grader, hp


def create(
    s: Session, settings: Settings, objects: ObjectStore, tenant: Tenant, req: FineTuningJobCreate
) -> FineTuningJob:
    """Translate, then create through the native service; its errors name OpenAI's fields."""
    kind, grader, hp = _check_method(req)
    train = s.get(File, req.training_file)
    if train is None or train.tenant_id != tenant.id:
        raise ApiError(404, "not_found", f"file {req.training_file} not found", "training_file")
    try:
        body = JobCreate(
            model=req.model,
            training_file=req.training_file,
            validation_file=req.validation_file,
            reward=grader,
            tools=_http_tools(req.method.reinforcement.tools if req.method and req.method.reinforcement else None),
            hyperparameters=to_native(hp, train.rows, req.validation_file is not None, kind),
            name=req.suffix,
            metadata=req.metadata or {},
            seed=req.seed if req.seed is not None else random.randrange(2**31),
            max_wall_seconds=None,
        )
        job, _ = native.create_row(s, settings, tenant, body, None, objects)
    except ApiError as exc:
        exc.field = field_param(exc.field, hp, kind)
        raise
    return job_object(s, job)


def _rows(s: Session, job: Job) -> int | None:
    return s.scalar(select(File.rows).where(File.id == job.training_file_id)) if job.training_file_id else None


def _estimated_finish(job: Job) -> int | None:
    if job.status != "running" or job.started_at is None or job.step <= 0:
        return None
    started = as_utc(job.started_at)
    elapsed = (datetime.now(UTC) - started).total_seconds()
    return unix(started) + int(elapsed / job.step * job.total_steps)  # type: ignore[operator]


def job_object(s: Session, job: Job) -> FineTuningJob:
    """Any job as OpenAI's ``fine_tuning.job``; ``fine_tuned_model``: ``ckpt:<final checkpoint>``."""
    final = None
    if job.status == "succeeded":
        final = s.scalar(select(Checkpoint.id).where(Checkpoint.job_id == job.id, Checkpoint.final.is_(True)))
    hp = from_native(job.hyperparameters, _rows(s, job))
    error = None
    if job.status == "failed":
        error = FineTuningJobError(code="job_failed", message=job.error or "the job failed", param=None)
    return FineTuningJob(
        id=job.id,
        model=job.model,
        fine_tuned_model=f"ckpt:{final}" if final else None,
        organization_id=job.tenant_id,
        status=STATUS.get(job.status, "failed"),
        created_at=unix(job.created_at) or 0,
        finished_at=unix(job.finished_at),
        estimated_finish=_estimated_finish(job),
        trained_tokens=job.tokens_trained or 0,
        error=error,
        result_files=results.result_file_ids(s, job.id),
        seed=job.seed,
        suffix=job.name,
        metadata={str(k): str(v) for k, v in (job.job_metadata or {}).items()},
        method=_method(job, hp),
        hyperparameters={k: hp[k] for k in ("batch_size", "learning_rate_multiplier", "n_epochs")},
        training_file=job.training_file_id,
        validation_file=job.validation_file_id,
        step=job.step,
        total_steps=job.total_steps,
        gspo_status=job.status,
        gspo_hyperparameters={**job.hyperparameters, "seed": job.seed},
    )


def _method(job: Job, hp: dict[str, Any]) -> dict[str, Any]:
    if job.hyperparameters.get("method") == "supervised":
        return {"type": "supervised", "supervised": {"hyperparameters": hp}}
    reinforcement = {"grader": redact_secrets(job.reward), "hyperparameters": hp}
    if job.hyperparameters.get("response_format"):
        reinforcement["response_format"] = job.hyperparameters["response_format"]
    if job.tools:
        reinforcement["tools"] = [_openai_tool(tool) for tool in redact_secrets(job.tools)]
    return {"type": "reinforcement", "reinforcement": reinforcement}


def _after(q: Any, last: Job) -> Any:
    return q.where((Job.created_at < last.created_at) | ((Job.created_at == last.created_at) & (Job.id < last.id)))


def list_jobs(
    s: Session, tenant: Tenant, after: str | None, limit: int, metadata: dict[str, str]
) -> ListOut[FineTuningJob]:
    """Newest first, after the job ``after``; only jobs whose metadata holds every ``metadata`` pair (read on in
    batches and matched here: JSON containment differs between SQLite and PostgreSQL)."""
    q = select(Job).where(Job.tenant_id == tenant.id).order_by(Job.created_at.desc(), Job.id.desc())
    last = None
    if after:
        last = s.get(Job, after)
        if last is None or last.tenant_id != tenant.id:
            raise ApiError(404, "not_found", f"job {after} not found", "after")
    found: list[Job] = []
    batch = limit + 1 if not metadata else 200
    while len(found) <= limit:
        rows = list(s.scalars((_after(q, last) if last is not None else q).limit(batch)))
        found += [j for j in rows if all((j.job_metadata or {}).get(k) == v for k, v in metadata.items())]
        if len(rows) < batch:
            break
        last = rows[-1]
    data = [job_object(s, j) for j in found[:limit]]
    return ListOut[FineTuningJob](
        data=data,
        has_more=len(found) > limit,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


def cancel(s: Session, settings: Settings, objects: ObjectStore, job: Job) -> FineTuningJob:
    native.cancel_job(s, settings, objects, job)
    return job_object(s, job)


def pause(s: Session, settings: Settings, job: Job) -> FineTuningJob:
    """The native pause; a job that cannot pause (finished, cancelling) is a 400, as OpenAI answers."""
    try:
        native.pause_job(s, settings, job)
    except ApiError as exc:
        raise _as_bad_request(exc) from None
    return job_object(s, job)


def resume(s: Session, settings: Settings, job: Job) -> FineTuningJob:
    try:
        native.resume_job(s, settings, job)
    except ApiError as exc:
        raise _as_bad_request(exc) from None
    return job_object(s, job)


def _as_bad_request(exc: ApiError) -> ApiError:
    if exc.status == 409:
        exc.status, exc.field = 400, None
    return exc

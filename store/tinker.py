"""Tinker API sessions: the session cap, the request queue (futures) and its leases, run by worker.sessions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from store.models import (
    TinkerCheckpoint,
    TinkerModel,
    TinkerRequest,
    TinkerSession,
    UsageRecord,
    new_id,
    utcnow,
)
from store.usage import QueuePolicy


class SessionCapReached(RuntimeError):
    """The tenant already has as many open sessions as it may."""


def open_session(s: Session, tenant_id: str, tags: list[str], cap: int, idle_seconds: float) -> TinkerSession:
    """A new active session (the tenant's idle ones closed first); :class:`SessionCapReached` at its cap."""
    close_idle(s, idle_seconds, tenant_id=tenant_id)
    active = s.scalar(
        select(func.count())
        .select_from(TinkerSession)
        .where(TinkerSession.tenant_id == tenant_id, TinkerSession.status == "active")
    )
    if int(active or 0) >= cap:
        raise SessionCapReached(f"{active} sessions are open, the most this tenant may have; close one first")
    row = TinkerSession(tenant_id=tenant_id, tags=tags)
    s.add(row)
    s.flush()
    return row


def owned(s: Session, model: type, row_id: str, tenant_id: str):
    """The tenant's row ``row_id`` of ``model``, else None (another tenant's row is as absent as a missing one)."""
    row = s.get(model, row_id)
    return row if row is not None and row.tenant_id == tenant_id else None


class ModelExists(RuntimeError):
    """The session already has a model of that sequence number."""


def new_model(
    s: Session,
    session: TinkerSession,
    kind: str,
    base_model: str,
    *,
    lora: dict | None,
    model_path: str | None,
    seq: int | None = None,
) -> TinkerModel:
    """A session's model; a training model's id is ``<session>:train:<seq>``, the id the SDK derives itself."""
    model_id = f"{session.id}:train:{seq}" if seq is not None else new_id("smp")
    if s.get(TinkerModel, model_id) is not None:
        raise ModelExists(f"model {model_id} exists already")
    row = TinkerModel(
        id=model_id,
        tenant_id=session.tenant_id,
        session_id=session.id,
        kind=kind,
        base_model=base_model,
        lora=lora,
        model_path=model_path,
    )
    s.add(row)
    s.flush()
    return row


def enqueue(s: Session, session: TinkerSession, kind: str, payload: dict, model_id: str | None) -> TinkerRequest:
    """A pending request: the session worker runs it after every earlier request of the session."""
    row = TinkerRequest(
        tenant_id=session.tenant_id, session_id=session.id, model_id=model_id, kind=kind, payload=payload
    )
    s.add(row)
    session.heartbeat_at = utcnow()
    s.flush()
    return row


def queued_ahead(s: Session, request: TinkerRequest) -> int:
    """How many of the session's requests run before this one."""
    return int(
        s.scalar(
            select(func.count())
            .select_from(TinkerRequest)
            .where(
                TinkerRequest.session_id == request.session_id,
                TinkerRequest.status.in_(("pending", "running")),
                TinkerRequest.created_at < request.created_at,
            )
        )
        or 0
    )


def claim_next(
    s: Session,
    worker: str,
    lease_seconds: float,
    policy: QueuePolicy | None = None,
    taken: Callable[[str], None] | None = None,
) -> TinkerRequest | None:
    """The next pending request of an active session this worker holds or may take (no lease: a dead worker's
    is freed by ``tinker_resume.reap_lost`` first), marked running, with the session's lease extended to
    ``worker``; None when there is none. ``taken`` is called with the session's id when the worker did not hold
    its lease, so that it drops any models it kept of it. The job queue's fair order: the tenant that used the
    least device time this budget period first, then the oldest request, so one tenant's queued requests cannot
    starve another's."""
    now = utcnow()
    policy = policy or QueuePolicy()
    used = (
        select(UsageRecord.tenant_id, func.sum(UsageRecord.device_seconds).label("used_s"))
        .where(UsageRecord.period_start == policy.period_start(now))
        .group_by(UsageRecord.tenant_id)
        .subquery()
    )
    free = or_(TinkerSession.lease_owner.is_(None), TinkerSession.lease_owner == worker)
    busy = select(TinkerRequest.session_id).where(TinkerRequest.status == "running")
    candidate = s.scalar(
        select(TinkerRequest)
        .join(TinkerSession, TinkerSession.id == TinkerRequest.session_id)
        .where(TinkerRequest.status == "pending", TinkerSession.status == "active", free)
        .where(TinkerRequest.session_id.not_in(busy))
        .outerjoin(used, used.c.tenant_id == TinkerRequest.tenant_id)
        .order_by(func.coalesce(used.c.used_s, 0.0), TinkerRequest.created_at, TinkerRequest.id)
        .limit(1)
    )
    if candidate is None:
        return None
    # Guarded: of two workers racing for one session, only one extends the lease.
    lease = {"lease_owner": worker, "lease_expires_at": now + timedelta(seconds=lease_seconds)}
    session = update(TinkerSession).where(TinkerSession.id == candidate.session_id)
    kept = s.execute(session.where(TinkerSession.lease_owner == worker).values(lease))
    if kept.rowcount != 1:  # type: ignore[attr-defined]
        fresh = s.execute(session.where(TinkerSession.lease_owner.is_(None)).values(lease))
        if fresh.rowcount != 1:  # type: ignore[attr-defined]
            s.rollback()
            return None
        if taken is not None:
            taken(candidate.session_id)
    candidate.status = "running"
    s.commit()
    return candidate


def claim_following(s: Session, first: TinkerRequest, cap: int) -> list[TinkerRequest]:
    """Up to ``cap`` of the session's pending requests queued next after ``first`` (a running ``sample``) that
    sample the same sampler, marked running: the worker serves them with ``first`` in one engine call. The
    session's lease and its running ``first`` keep every other worker off them."""
    rows = s.scalars(
        select(TinkerRequest)
        .where(TinkerRequest.session_id == first.session_id, TinkerRequest.status == "pending")
        .order_by(TinkerRequest.created_at, TinkerRequest.id)
        .limit(cap)
    ).all()
    taken = []
    for row in rows:
        if row.kind != first.kind or row.model_id != first.model_id:
            break
        row.status = "running"
        taken.append(row)
    s.commit()
    return taken


def renew_lease(s: Session, worker: str, lease_seconds: float) -> None:
    s.execute(
        update(TinkerSession)
        .where(TinkerSession.lease_owner == worker, TinkerSession.status == "active")
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds))
    )
    s.commit()


def finish(s: Session, request_id: str, result: dict | None, error: str | None = None, category: str = "user") -> None:
    """A running request's result or error; one failed meanwhile (its session closed, or reaped from a worker that
    lost its lease) keeps that error."""
    row = s.get(TinkerRequest, request_id)
    if row is None or row.status != "running":
        return
    row.status = "failed" if error is not None else "done"
    row.result, row.error = result, error
    row.error_category = category if error is not None else None
    row.finished_at = utcnow()
    if row.model_id is not None:
        s.execute(update(TinkerModel).where(TinkerModel.id == row.model_id).values(last_request_at=row.finished_at))
    s.commit()


def close_idle(s: Session, idle_seconds: float, tenant_id: str | None = None) -> list[str]:
    """Close the active sessions (of one tenant, or all) idle for ``idle_seconds`` (no heartbeat, no request)."""
    cutoff = utcnow() - timedelta(seconds=idle_seconds)
    query = select(TinkerSession).where(TinkerSession.status == "active", TinkerSession.heartbeat_at < cutoff)
    if tenant_id is not None:
        query = query.where(TinkerSession.tenant_id == tenant_id)
    closed = []
    for row in s.scalars(query).all():
        close(s, row, f"idle for more than {idle_seconds:.0f} s")
        closed.append(row.id)
    s.commit()
    return closed


def close(s: Session, session: TinkerSession, reason: str) -> None:
    """Close a session: its pending requests fail, its models are unloaded."""
    session.status, session.closed_reason, session.lease_owner = "closed", reason, None
    s.execute(
        update(TinkerRequest)
        .where(TinkerRequest.session_id == session.id, TinkerRequest.status.in_(("pending", "running")))
        .values(status="failed", error=f"session closed: {reason}", error_category="user", finished_at=utcnow())
    )
    s.execute(update(TinkerModel).where(TinkerModel.session_id == session.id).values(status="unloaded"))


def record_checkpoint(
    s: Session, model: TinkerModel, kind: str, name: str, directory: str, object_prefix: str, size: int
) -> TinkerCheckpoint:
    """The model's ``kind`` checkpoint ``name`` as just saved (a name saved again is that save now)."""
    row = s.scalar(
        select(TinkerCheckpoint).where(
            TinkerCheckpoint.model_id == model.id, TinkerCheckpoint.kind == kind, TinkerCheckpoint.name == name
        )
    )
    if row is None:
        row = TinkerCheckpoint(tenant_id=model.tenant_id, model_id=model.id, kind=kind, name=name)
        s.add(row)
    row.directory, row.object_prefix, row.size_bytes, row.created_at = directory, object_prefix, size, utcnow()
    s.commit()
    return row


def find_checkpoint(s: Session, tenant_id: str, model_id: str, kind: str, name: str) -> TinkerCheckpoint | None:
    return s.scalar(
        select(TinkerCheckpoint).where(
            TinkerCheckpoint.tenant_id == tenant_id,
            TinkerCheckpoint.model_id == model_id,
            TinkerCheckpoint.kind == kind,
            TinkerCheckpoint.name == name,
        )
    )


#: A ``tinker://`` path's middle segment: the kind of checkpoint it names.
CHECKPOINT_SEGMENTS = {"weights": "training", "sampler_weights": "sampler"}


def checkpoint_at(s: Session, tenant_id: str, path: str) -> TinkerCheckpoint | None:
    """The tenant's checkpoint at a ``tinker://<run>/<weights|sampler_weights>/<name>`` path, else None;
    ValueError where ``path`` is not of that form."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in CHECKPOINT_SEGMENTS:
        raise ValueError(f"not a tinker://<run id>/<weights|sampler_weights>/<name> path: {path}")
    return find_checkpoint(s, tenant_id, parts[0], CHECKPOINT_SEGMENTS[parts[1]], parts[2])


def add_usage(
    s: Session, policy: QueuePolicy, request: TinkerRequest, worker: str, seconds: float, sampled: int, trained: int
) -> None:
    """Count one request's device time and tokens in the tenant's usage (a usage row per session, worker and
    budget period, ``job_id`` being the session's id), so sessions spend the same budget as jobs."""
    period = policy.period_start(utcnow())
    key = (UsageRecord.job_id == request.session_id, UsageRecord.run_id == worker, UsageRecord.period_start == period)
    row = s.scalar(select(UsageRecord).where(*key))
    if row is None:
        row = UsageRecord(
            tenant_id=request.tenant_id, job_id=request.session_id, run_id=worker, attempt=1, period_start=period
        )
        row.device_seconds, row.tokens_sampled, row.tokens_trained = 0.0, 0, 0
        s.add(row)
    row.device_seconds += seconds
    row.tokens_sampled += sampled
    row.tokens_trained += trained


@dataclass(frozen=True)
class SessionSummary:
    """A session as its tenant's listings show it: its models, steps, usage and last activity."""

    id: str
    status: str
    closed_reason: str | None
    created_at: datetime
    last_activity_at: datetime
    base_models: list[str]
    training_run_ids: list[str]
    sampler_ids: list[str]
    steps: int
    pending: int
    device_seconds: float
    tokens_sampled: int
    tokens_trained: int


def tenant_sessions(s: Session, tenant_id: str, limit: int, offset: int = 0) -> list[TinkerSession]:
    """The tenant's sessions, newest first."""
    query = select(TinkerSession).where(TinkerSession.tenant_id == tenant_id)
    return list(
        s.scalars(query.order_by(TinkerSession.created_at.desc(), TinkerSession.id).limit(limit).offset(offset))
    )


def session_models(s: Session, session_id: str) -> list[TinkerModel]:
    return list(
        s.scalars(select(TinkerModel).where(TinkerModel.session_id == session_id).order_by(TinkerModel.created_at))
    )


def summarize(s: Session, session: TinkerSession) -> SessionSummary:
    """One session's summary (a few indexed queries: listings show tens of sessions, not thousands)."""
    models = session_models(s, session.id)
    pending = s.scalar(
        select(func.count())
        .select_from(TinkerRequest)
        .where(TinkerRequest.session_id == session.id, TinkerRequest.status.in_(("pending", "running")))
    )
    steps = s.scalar(
        select(func.count())
        .select_from(TinkerRequest)
        .where(
            TinkerRequest.session_id == session.id, TinkerRequest.kind == "optim_step", TinkerRequest.status == "done"
        )
    )
    usage = s.execute(
        select(
            func.sum(UsageRecord.device_seconds),
            func.sum(UsageRecord.tokens_sampled),
            func.sum(UsageRecord.tokens_trained),
        ).where(UsageRecord.job_id == session.id, UsageRecord.tenant_id == session.tenant_id)
    ).one()
    last = max([session.heartbeat_at, *(m.last_request_at for m in models)])
    return SessionSummary(
        id=session.id,
        status=session.status,
        closed_reason=session.closed_reason,
        created_at=session.created_at,
        last_activity_at=last,
        base_models=sorted({m.base_model for m in models if m.kind == "training"}),
        training_run_ids=[m.id for m in models if m.kind == "training"],
        sampler_ids=[m.id for m in models if m.kind == "sampling"],
        steps=int(steps or 0),
        pending=int(pending or 0),
        device_seconds=float(usage[0] or 0.0),
        tokens_sampled=int(usage[1] or 0),
        tokens_trained=int(usage[2] or 0),
    )

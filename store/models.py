"""SQLAlchemy tables (persistence only; API schemas live in api/schemas.py)."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import TYPE_CHECKING, ClassVar

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

if TYPE_CHECKING:
    from sqlalchemy import Table


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class Base(DeclarativeBase):
    if TYPE_CHECKING:
        # Every model here is declared as a Table (never mapped to a subquery): the upserts hand
        # ``__table__`` to the dialects' insert(), which SQLAlchemy types as FromClause by default.
        __table__: ClassVar[Table]


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("tn"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class File(Base):
    __tablename__ = "files"
    # ``job_id``: the job whose results file this is (purpose fine-tune-results), at most one per job. No
    # foreign key: the file is the tenant's and outlives the job (like its usage records).
    __table_args__ = (Index("ix_files_job_id", "job_id", unique=True),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    object_key: Mapped[str] = mapped_column(String(512))
    item_fields: Mapped[list] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    purpose: Mapped[str] = mapped_column(String(32), default="fine-tune", server_default="fine-tune")
    job_id: Mapped[str | None] = mapped_column(String(40), nullable=True)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency"),
        Index("ix_jobs_status_created", "status", "created_at"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("job"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    model: Mapped[str] = mapped_column(String(512))
    # NULL once the file is deleted (allowed only when no active job uses it): the job's history stays.
    training_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id", ondelete="SET NULL"), nullable=True)
    validation_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id", ondelete="SET NULL"), nullable=True)
    reward: Mapped[dict] = mapped_column(JSON)
    # Tool specs the model may call (gspo_core.agents.tools); NULL: none.
    tools: Mapped[list | None] = mapped_column(JSON, nullable=True)
    # Where prompts and rewards come from instead of files (gspo_core.environments); NULL: the files.
    environment: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # The held-out evaluation {"before": {...}, "after": {...}} (gspo_core.callbacks.Evaluation); NULL: none yet.
    evaluation: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    hyperparameters: Mapped[dict] = mapped_column(JSON)
    job_metadata: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer)
    latest_metrics: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # of `step`, for status polls
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Lease: the worker holding the job renews lease_until; a stale lease may be taken over.
    worker_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    # Device time the job asked to be limited to (None: the operator's limit), and its usage so far,
    # summed over attempts (store.usage; the worker writes absolute values, so a retried write is harmless).
    max_wall_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Devices (trainer ranks) the job runs on: only a worker with at least as many takes it.
    devices: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    device_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    tokens_sampled: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class JobEvent(Base):
    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class StepMetric(Base):
    __tablename__ = "step_metrics"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_step_metrics_job_step"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Sample(Base):
    __tablename__ = "samples"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_samples_job_step"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    rows: Mapped[list] = mapped_column(JSON)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ckpt"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    object_prefix: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    metrics: Mapped[dict] = mapped_column(JSON, default=dict)
    final: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class UsageRecord(Base):
    """Device time and tokens of one run of a job (one claim, ``run_id``) within one budget period.

    ``job_id`` is deliberately no foreign key: a tenant's usage outlives the jobs it deletes, so
    deleting jobs never hands budget back.
    """

    __tablename__ = "usage_records"
    __table_args__ = (
        UniqueConstraint("job_id", "run_id", "period_start", name="uq_usage_records_run_period"),
        Index("ix_usage_records_tenant_period", "tenant_id", "period_start"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    run_id: Mapped[str] = mapped_column(String(200))
    attempt: Mapped[int] = mapped_column(Integer)
    period_start: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    device_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    tokens_sampled: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0)


class PendingDeletion(Base):
    """Stored objects whose rows are gone: written in the transaction that deletes the rows, removed
    once the objects are, so a crash or an object-store outage in between is retried, never leaked."""

    __tablename__ = "pending_deletions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    prefix: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookEndpoint(Base):
    """A tenant's URL for job events. ``secret`` is kept as given (the sender signs with it), as graders'
    credentials are kept in ``jobs.reward``: in the service's private database, never returned after creation."""

    __tablename__ = "webhook_endpoints"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("wh"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    events: Mapped[list] = mapped_column(JSON)
    secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The last change of the URL, name, events or secret (None: never changed since created_at).
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # After a rotation that keeps the old secret for a while, deliveries carry a signature by each.
    previous_secret: Mapped[str | None] = mapped_column(String(100), nullable=True)
    previous_secret_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class WebhookDelivery(Base):
    """One event for one endpoint (the outbox): written in the transaction that ends the job, sent by the
    workers' sender (worker/webhooks.py). ``payload`` is the exact body, signed and sent on every attempt;
    ``history`` one entry per attempt (time, status code, error text without the remote body)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("msg"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    event_id: Mapped[str] = mapped_column(String(40))
    event_type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    history: Mapped[list] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class TinkerSession(Base):
    """A client's session (Tinker API): its models and requests live and die with it; a session worker
    holds its models while ``lease_owner``'s lease runs."""

    __tablename__ = "tinker_sessions"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ts"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(16), default="active")  # active | closed
    tags: Mapped[list] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    closed_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class TinkerModel(Base):
    """A training run (``kind`` training) or a sampler (``kind`` sampling) of a session."""

    __tablename__ = "tinker_models"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_sessions.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    base_model: Mapped[str] = mapped_column(String(512))
    # The sampler's weights: a tinker:// path of a sampler checkpoint, or NULL for the base model.
    model_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    lora: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="active")  # active | unloaded
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_request_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TinkerCheckpoint(Base):
    """Saved weights of a training run: ``kind`` training (state, with the optimizer) or sampler (HF export)."""

    __tablename__ = "tinker_checkpoints"
    __table_args__ = (UniqueConstraint("model_id", "kind", "name", name="uq_tinker_checkpoints_name"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("tck"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    model_id: Mapped[str] = mapped_column(String(40), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # training | sampler
    name: Mapped[str] = mapped_column(String(200))
    directory: Mapped[str] = mapped_column(String(1024))  # on the session worker's disk
    object_prefix: Mapped[str] = mapped_column(String(512))  # the copy in object storage (<prefix>/model/...)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TinkerRequest(Base):
    """One queued call on a session (the client's future): the session worker runs a session's requests
    in the order they arrived and writes ``result`` (JSON) or ``error``."""

    __tablename__ = "tinker_requests"
    __table_args__ = (Index("ix_tinker_requests_session_status", "session_id", "status", "created_at"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("tr"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_sessions.id", ondelete="CASCADE"))
    model_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    kind: Mapped[str] = mapped_column(String(32))
    payload: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | running | done | failed
    result: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_category: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

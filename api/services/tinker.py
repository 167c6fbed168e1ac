"""Tinker API sessions: open sessions, queue requests (the futures), read their results, resolve tinker:// paths."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError, not_found
from store import tinker
from store.db import Database
from store.model_refs import ModelRefError, check_local_or_hub
from store.models import TinkerCheckpoint, TinkerModel, TinkerRequest, TinkerSession
from store.settings import Settings

# Losses the session worker runs (gspo_core.primitives' registry); checked here so a typo is a 400 at once.
LOSSES = frozenset(
    {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce", "gspo_token"}
)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
CHECKPOINT_SEGMENTS = {"weights": "training", "sampler_weights": "sampler"}


@dataclass(frozen=True)
class FutureState:
    """A request as retrieve_future reports it."""

    kind: str
    status: str
    result: dict | None
    error: str | None
    category: str | None
    ahead: int


def open_session(s: Session, settings: Settings, tenant_id: str, tags: list[str]) -> TinkerSession:
    try:
        row = tinker.open_session(
            s, tenant_id, tags, settings.max_active_sessions_per_tenant, settings.session_idle_seconds
        )
    except tinker.SessionCapReached as exc:
        raise ApiError(429, "rate_limit_exceeded", str(exc), headers={"Retry-After": "30"}) from exc
    s.commit()
    return row


def session_of(s: Session, tenant_id: str, session_id: str) -> TinkerSession:
    row = tinker.owned(s, TinkerSession, session_id, tenant_id)
    if row is None:
        raise not_found("session", session_id)
    if row.status != "active":
        raise ApiError(409, "session_closed", f"session {session_id} is closed: {row.closed_reason}", "session_id")
    return row


def model_of(s: Session, tenant_id: str, model_id: str, kind: str = "training") -> TinkerModel:
    row = tinker.owned(s, TinkerModel, model_id, tenant_id)
    if row is None or row.kind != kind:
        raise not_found("model" if kind == "training" else "sampler", model_id)
    if row.status != "active":
        raise ApiError(409, "model_unloaded", f"{model_id} was unloaded", "model_id")
    return row


def new_training_model(s: Session, session: TinkerSession, base: str, lora: dict | None, seq: int) -> TinkerModel:
    try:
        return tinker.new_model(s, session, "training", base, lora=lora, model_path=None, seq=seq)
    except tinker.ModelExists as exc:
        raise ApiError(409, "conflict", str(exc), "model_seq_id") from exc


def check_model(settings: Settings, base_model: str) -> None:
    try:
        check_local_or_hub(settings, base_model)
    except ModelRefError as exc:
        raise ApiError(400, "invalid_request", str(exc), "base_model") from exc


def check_loss(loss: str) -> None:
    if loss not in LOSSES:
        raise ApiError(400, "invalid_request", f"unknown loss_fn {loss!r}; supported: {sorted(LOSSES)}", "loss_fn")


def enqueue(s: Session, session: TinkerSession, kind: str, payload: dict, model_id: str | None) -> dict[str, Any]:
    """Queue a request and answer the SDK's UntypedAPIFuture."""
    row = tinker.enqueue(s, session, kind, payload, model_id)
    s.commit()
    return {"request_id": row.id, "model_id": model_id}


def enqueue_on_model(s: Session, model: TinkerModel, kind: str, payload: dict) -> dict[str, Any]:
    session = session_of(s, model.tenant_id, model.session_id)
    return enqueue(s, session, kind, payload, model.id)


def checkpoint_dir(settings: Settings, model: TinkerModel, kind: str, name: str) -> str:
    """Where the worker writes a checkpoint: chosen here, never by the tenant."""
    return str(Path(settings.data_dir) / "tinker" / model.tenant_id / model.id / kind / name)


def checkpoint_name(path: str | None, default: str) -> str:
    name = path or default
    if not NAME.match(name):
        raise ApiError(400, "invalid_request", "path must be a name of letters, digits, '.', '_' or '-'", "path")
    return name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    segment = "weights" if kind == "training" else "sampler_weights"
    return f"tinker://{model_id}/{segment}/{name}"


def resolve_path(s: Session, tenant_id: str, path: str, field: str) -> TinkerCheckpoint:
    """A tinker://<run>/<weights|sampler_weights>/<name> path of the tenant's; 400 malformed, 404 otherwise."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in CHECKPOINT_SEGMENTS:
        raise ApiError(400, "invalid_request", "expected tinker://<run id>/<weights|sampler_weights>/<name>", field)
    row = tinker.find_checkpoint(s, tenant_id, parts[0], CHECKPOINT_SEGMENTS[parts[1]], parts[2])
    if row is None:
        raise not_found("checkpoint", path)
    return row


def _future_state(db: Database, tenant_id: str, request_id: str) -> FutureState | None:
    with db.read_session() as s:
        row = tinker.owned(s, TinkerRequest, request_id, tenant_id)
        if row is None:
            return None
        ahead = tinker.queued_ahead(s, row) if row.status == "pending" else 0
        return FutureState(row.kind, row.status, row.result, row.error, row.error_category, ahead)


async def wait_future(db: Database, tenant_id: str, request_id: str, wait_s: float, poll_s: float = 0.1) -> FutureState:
    """The request once finished, or as it stands after ``wait_s`` (the SDK polls again at once)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        state = await run_in_threadpool(_future_state, db, tenant_id, request_id)
        if state is None:
            raise not_found("future", request_id)
        if state.status in ("done", "failed", "expired") or loop.time() >= deadline:
            return state
        await asyncio.sleep(poll_s)


def training_runs(s: Session, tenant_id: str, limit: int, offset: int) -> list[TinkerModel]:
    return list(
        s.scalars(
            select(TinkerModel)
            .where(TinkerModel.tenant_id == tenant_id, TinkerModel.kind == "training")
            .order_by(TinkerModel.created_at.desc())
            .limit(limit)
            .offset(offset)
        )
    )


def checkpoints_of(s: Session, tenant_id: str, model_id: str | None) -> list[TinkerCheckpoint]:
    query = select(TinkerCheckpoint).where(TinkerCheckpoint.tenant_id == tenant_id)
    if model_id is not None:
        query = query.where(TinkerCheckpoint.model_id == model_id)
    return list(s.scalars(query.order_by(TinkerCheckpoint.created_at)))


def checkpoint_json(row: TinkerCheckpoint) -> dict[str, Any]:
    segment = "weights" if row.kind == "training" else "sampler_weights"
    return {
        "checkpoint_id": f"{segment}/{row.name}",
        "checkpoint_type": row.kind,
        "time": row.created_at.isoformat(),
        "tinker_path": tinker_path(row.model_id, row.kind, row.name),
        "size_bytes": row.size_bytes,
    }


def training_run_json(model: TinkerModel, tenant_name: str, checkpoints: list[TinkerCheckpoint]) -> dict[str, Any]:
    lora = model.lora or {}
    last = {k: [c for c in checkpoints if c.kind == k] for k in ("training", "sampler")}
    return {
        "training_run_id": model.id,
        "base_model": model.base_model,
        "model_owner": tenant_name,
        "is_lora": bool(lora),
        "lora_rank": lora.get("rank"),
        "last_request_time": model.last_request_at.isoformat(),
        "last_checkpoint": checkpoint_json(last["training"][-1]) if last["training"] else None,
        "last_sampler_checkpoint": checkpoint_json(last["sampler"][-1]) if last["sampler"] else None,
    }

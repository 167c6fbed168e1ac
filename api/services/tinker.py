"""Tinker API sessions: open sessions, queue requests (the futures), read their results, resolve tinker:// paths."""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError, not_found
from api.tinker_schemas import CreateSamplingSession, LoadWeights, Sample, SaveWeights
from store import tinker
from store.db import Database
from store.model_refs import ModelRefError, check_local_or_hub
from store.models import TinkerCheckpoint, TinkerModel, TinkerRequest, TinkerSession, utcnow
from store.settings import Settings

# Losses the session worker runs (gspo_core.primitives' registry); checked here so a typo is a 400 at once.
LOSSES = frozenset(
    {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce", "gspo_token"}
)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


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
    try:
        row = tinker.checkpoint_at(s, tenant_id, path)
    except ValueError:
        raise ApiError(
            400, "invalid_request", "expected tinker://<run id>/<weights|sampler_weights>/<name>", field
        ) from None
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


async def retrieve(db: Database, tenant_id: str, request_id: str, wait_s: float) -> FutureState:
    """``wait_future``; a request that an earlier version marked expired when its worker died answers 410 (the SDK
    raises it; requests lost with their worker now fail, saying so: store.tinker_resume)."""
    state = await wait_future(db, tenant_id, request_id, wait_s)
    if state.status == "expired":
        raise ApiError(410, "gone", f"request {request_id} was lost with its worker; send it again")
    return state


def supported_models(settings: Settings) -> list[str]:
    """The base models under the models directory (each a folder with a config.json)."""
    root = Path(settings.models_dir)
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []


def heartbeat(s: Session, tenant_id: str, session_id: str) -> None:
    row = session_of(s, tenant_id, session_id)
    row.heartbeat_at = utcnow()
    s.commit()


def create_model(
    s: Session, settings: Settings, tenant_id: str, session_id: str, base: str, lora: dict | None, seq: int
) -> dict[str, Any]:
    session = session_of(s, tenant_id, session_id)
    check_model(settings, base)
    model = new_training_model(s, session, base, lora, seq)
    return enqueue(s, session, "create_model", {"base_model": base, "lora": lora}, model.id)


def unload_model(s: Session, tenant_id: str, model_id: str) -> dict[str, Any]:
    model = model_of(s, tenant_id, model_id)
    future = enqueue_on_model(s, model, "unload", {})
    model.status = "unloaded"
    s.commit()
    return future


def queue_fwdbwd(s: Session, tenant_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Queue a decoded forward(_backward) body (``tinker_wire.fwdbwd_payload``) on its model."""
    model = model_of(s, tenant_id, payload.pop("model_id"))
    check_loss(payload["loss"])
    if not payload["data"]:
        raise ApiError(400, "invalid_request", "data must hold at least one datum", "data")
    for i, datum in enumerate(payload["data"]):
        if "target_tokens" not in datum["inputs"] or len(datum["inputs"]["target_tokens"]) != len(datum["tokens"]):
            raise ApiError(400, "invalid_request", "target_tokens must be as long as the model input", f"data[{i}]")
    kind = "forward" if payload["forward_only"] else "forward_backward"
    return enqueue_on_model(s, model, kind, payload)


def save_weights(s: Session, tenant_id: str, body: SaveWeights, kind: str) -> dict[str, Any]:
    """Queue a ``kind`` ("training" or "sampler") checkpoint, named by the tenant or here; the worker stores it
    under its own data directory and in object storage, at a prefix made of the tenant, model, kind and name
    (``store.tinker_files``), so the tenant names no path and the API none of its own."""
    model = model_of(s, tenant_id, body.model_id)
    name = checkpoint_name(body.path, f"{kind}-{uuid.uuid4().hex[:8]}")
    payload = {
        "kind": kind,
        "name": name,
        "path": tinker_path(model.id, kind, name),
    }
    if kind == "sampler" and body.path is None:  # save_weights_and_get_sampling_client: a sampler of its own
        session = session_of(s, tenant_id, model.session_id)
        sampler = tinker.new_model(s, session, "sampling", model.base_model, lora=None, model_path=payload["path"])
        payload["sampling_session_id"] = sampler.id
    return enqueue_on_model(s, model, "save_weights", payload)


def load_weights(s: Session, tenant_id: str, body: LoadWeights) -> dict[str, Any]:
    """Queue loading a training checkpoint into a model, or into a new one made from the checkpoint's run."""
    ckpt = resolve_path(s, tenant_id, body.path, "path")
    if ckpt.kind != "training":
        raise ApiError(400, "invalid_request", "load_weights takes a tinker://.../weights/... path", "path")
    if body.model_id is not None:
        model = model_of(s, tenant_id, body.model_id)
    elif body.session_id is not None and body.model_seq_id is not None:  # a new model, from the checkpoint's run
        session = session_of(s, tenant_id, body.session_id)
        source = s.get(TinkerModel, ckpt.model_id)
        assert source is not None
        base = body.base_model or source.base_model
        model = new_training_model(s, session, base, source.lora, body.model_seq_id)
        enqueue(s, session, "create_model", {"base_model": base, "lora": source.lora}, model.id)
    else:
        raise ApiError(400, "invalid_request", "give model_id, or session_id and model_seq_id", "model_id")
    payload = {"optimizer": body.optimizer, "path": body.path}  # the worker finds the checkpoint's files by its path
    return enqueue_on_model(s, model, "load_weights", payload)


def create_sampler(s: Session, settings: Settings, tenant_id: str, body: CreateSamplingSession) -> TinkerModel:
    """A sampling session on a sampler checkpoint or a base model."""
    session = session_of(s, tenant_id, body.session_id)
    if body.model_path is not None:
        ckpt = resolve_path(s, tenant_id, body.model_path, "model_path")
        if ckpt.kind != "sampler":
            raise ApiError(400, "invalid_request", "sample from a tinker://.../sampler_weights/... path", "model_path")
        base = model_of(s, tenant_id, ckpt.model_id).base_model
    elif body.base_model is not None:
        check_model(settings, body.base_model)
        base = body.base_model
    else:
        raise ApiError(400, "invalid_request", "give model_path or base_model", "model_path")
    sampler = tinker.new_model(s, session, "sampling", base, lora=None, model_path=body.model_path)
    s.commit()
    return sampler


def sample(s: Session, tenant_id: str, body: Sample) -> dict[str, Any]:
    """Queue a sample request; the future names one sequence id per sample."""
    if body.sampling_session_id is None:
        raise ApiError(400, "invalid_request", "sampling_session_id is required", "sampling_session_id")
    sampler = model_of(s, tenant_id, body.sampling_session_id, kind="sampling")
    chunks = body.prompt.get("chunks") or []
    tokens = [t for chunk in chunks for t in chunk.get("tokens", [])]
    if not tokens or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise ApiError(400, "invalid_request", "prompt must hold encoded_text chunks of token ids", "prompt")
    payload = {
        "tokens": tokens,
        "n": body.num_samples,
        "params": body.sampling_params.model_dump(),
        "prompt_logprobs": bool(body.prompt_logprobs),
    }
    future = enqueue_on_model(s, sampler, "sample", payload)
    return {**future, "sample_sequence_ids": [f"{future['request_id']}-{i}" for i in range(body.num_samples)]}

"""Tinker-compatible API (`/api/v1/...`, what the `tinker` SDK 0.38 calls): sessions, models, training and
sampling requests queued as futures for the session worker, and retrieve_future."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from api import tinker_wire
from api.bodies import StrictJsonRoute
from api.deps import DatabaseDep, SessionDep, SettingsDep, TinkerTenantDep
from api.errors import ApiError
from api.services import tinker as svc
from api.tinker_schemas import (
    CreateModel,
    CreateSamplingSession,
    CreateSession,
    LoadWeights,
    ModelRef,
    OptimStep,
    RetrieveFuture,
    Sample,
    SaveWeights,
    SessionRef,
)
from gspo_core.data import JsonValueError, loads_strict
from store import tinker
from store.models import TinkerModel, utcnow

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=StrictJsonRoute)


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.post("/client/config")
def client_config(_tenant: TinkerTenantDep) -> dict:
    # API keys only (no JWT exchange), uncompressed protobuf forward_backward bodies, per-request futures.
    return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False}


@router.post("/client/dynamic_config")
def client_dynamic_config(_tenant: TinkerTenantDep) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
async def telemetry() -> dict:
    return {"status": "accepted"}  # the SDK's telemetry is accepted and dropped


@router.get("/get_server_capabilities")
def server_capabilities(_tenant: TinkerTenantDep, settings: SettingsDep) -> dict:
    root = Path(settings.models_dir)
    names = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []
    return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True} for n in names]}


@router.post("/create_session")
def create_session(body: CreateSession, tenant: TinkerTenantDep, s: SessionDep, settings: SettingsDep) -> dict:
    row = svc.open_session(s, settings, tenant.id, body.tags)
    return {"type": "create_session", "session_id": row.id}


@router.post("/session_heartbeat")
def session_heartbeat(body: SessionRef, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    row = svc.session_of(s, tenant.id, body.session_id)
    row.heartbeat_at = utcnow()
    s.commit()
    return {"type": "session_heartbeat"}


@router.post("/create_model")
def create_model(body: CreateModel, tenant: TinkerTenantDep, s: SessionDep, settings: SettingsDep) -> dict:
    session = svc.session_of(s, tenant.id, body.session_id)
    svc.check_model(settings, body.base_model)
    lora = body.lora_config.model_dump() if body.lora_config else None
    model = svc.new_training_model(s, session, body.base_model, lora, body.model_seq_id)
    return svc.enqueue(s, session, "create_model", {"base_model": body.base_model, "lora": lora}, model.id)


@router.post("/get_info")
def get_info(body: ModelRef, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    model = svc.model_of(s, tenant.id, body.model_id)
    lora = model.lora or {}
    return {
        "type": "get_info",
        "model_id": model.id,
        "model_data": {"arch": "causal_lm", "model_name": model.base_model, "tokenizer_id": model.base_model},
        "is_lora": bool(lora),
        "lora_rank": lora.get("rank"),
        "model_name": model.base_model,
    }


@router.post("/unload_model")
def unload_model(body: ModelRef, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    model = svc.model_of(s, tenant.id, body.model_id)
    future = svc.enqueue_on_model(s, model, "unload", {})
    model.status = "unloaded"
    s.commit()
    return future


async def _fwdbwd_payload(request: Request, forward_only: bool) -> dict[str, Any]:
    body = await request.body()
    if tinker_wire.PROTOBUF in request.headers.get("content-type", ""):
        if request.headers.get("content-encoding"):
            raise ApiError(415, "unsupported_media_type", "compressed bodies are not accepted", "Content-Encoding")
        return tinker_wire.fwdbwd_from_proto(body)
    try:
        parsed = loads_strict(body)  # bounded nesting, finite numbers, bounded integers (api/bodies.py)
    except JsonValueError as exc:
        raise ApiError(400, "invalid_request", f"{exc.path or 'body'}: {exc.message}", exc.path or "body") from None
    except ValueError as exc:
        raise ApiError(400, "invalid_request", f"body is neither protobuf nor JSON: {exc}", "body") from None
    if not isinstance(parsed, dict):
        raise ApiError(400, "invalid_request", "body must be a JSON object", "body")
    return tinker_wire.fwdbwd_from_json(parsed, forward_only or bool(parsed.get("forward_only")))


def _queue_fwdbwd(s, tenant_id: str, payload: dict[str, Any]) -> dict:
    model = svc.model_of(s, tenant_id, payload.pop("model_id"))
    svc.check_loss(payload["loss"])
    if not payload["data"]:
        raise ApiError(400, "invalid_request", "data must hold at least one datum", "data")
    for i, datum in enumerate(payload["data"]):
        if "target_tokens" not in datum["inputs"] or len(datum["inputs"]["target_tokens"]) != len(datum["tokens"]):
            raise ApiError(400, "invalid_request", "target_tokens must be as long as the model input", f"data[{i}]")
    kind = "forward" if payload["forward_only"] else "forward_backward"
    return svc.enqueue_on_model(s, model, kind, payload)


@router.post("/forward_backward")
async def forward_backward(request: Request, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    payload = await _fwdbwd_payload(request, forward_only=False)
    return _queue_fwdbwd(s, tenant.id, payload)


@router.post("/forward")
async def forward(request: Request, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    payload = await _fwdbwd_payload(request, forward_only=True)
    return _queue_fwdbwd(s, tenant.id, payload)


@router.post("/optim_step")
def optim_step(body: OptimStep, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    model = svc.model_of(s, tenant.id, body.model_id)
    return svc.enqueue_on_model(s, model, "optim_step", {"adam": body.adam_params.model_dump()})


def _save(s, settings, tenant_id: str, body: SaveWeights, kind: str) -> dict:
    model = svc.model_of(s, tenant_id, body.model_id)
    name = svc.checkpoint_name(body.path, f"{kind}-{uuid.uuid4().hex[:8]}")
    payload = {
        "kind": kind,
        "name": name,
        "directory": svc.checkpoint_dir(settings, model, kind, name),
        "path": svc.tinker_path(model.id, kind, name),
    }
    if kind == "sampler" and body.path is None:  # save_weights_and_get_sampling_client: a sampler of its own
        session = svc.session_of(s, tenant_id, model.session_id)
        sampler = tinker.new_model(s, session, "sampling", model.base_model, lora=None, model_path=payload["path"])
        payload["sampling_session_id"] = sampler.id
    return svc.enqueue_on_model(s, model, "save_weights", payload)


@router.post("/save_weights")
def save_weights(body: SaveWeights, tenant: TinkerTenantDep, s: SessionDep, settings: SettingsDep) -> dict:
    return _save(s, settings, tenant.id, body, "training")


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveWeights, tenant: TinkerTenantDep, s: SessionDep, settings: SettingsDep) -> dict:
    return _save(s, settings, tenant.id, body, "sampler")


@router.post("/load_weights")
def load_weights(body: LoadWeights, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    ckpt = svc.resolve_path(s, tenant.id, body.path, "path")
    if ckpt.kind != "training":
        raise ApiError(400, "invalid_request", "load_weights takes a tinker://.../weights/... path", "path")
    if body.model_id is not None:
        model = svc.model_of(s, tenant.id, body.model_id)
    elif body.session_id is not None and body.model_seq_id is not None:  # a new model, from the checkpoint's run
        session = svc.session_of(s, tenant.id, body.session_id)
        source = s.get(TinkerModel, ckpt.model_id)
        assert source is not None
        base = body.base_model or source.base_model
        model = svc.new_training_model(s, session, base, source.lora, body.model_seq_id)
        svc.enqueue(s, session, "create_model", {"base_model": base, "lora": source.lora}, model.id)
    else:
        raise ApiError(400, "invalid_request", "give model_id, or session_id and model_seq_id", "model_id")
    payload = {"directory": ckpt.directory, "optimizer": body.optimizer, "path": body.path}
    return svc.enqueue_on_model(s, model, "load_weights", payload)


@router.post("/create_sampling_session")
def create_sampling_session(
    body: CreateSamplingSession, tenant: TinkerTenantDep, s: SessionDep, settings: SettingsDep
) -> dict:
    session = svc.session_of(s, tenant.id, body.session_id)
    if body.model_path is not None:
        ckpt = svc.resolve_path(s, tenant.id, body.model_path, "model_path")
        if ckpt.kind != "sampler":
            raise ApiError(400, "invalid_request", "sample from a tinker://.../sampler_weights/... path", "model_path")
        base = svc.model_of(s, tenant.id, ckpt.model_id).base_model
    elif body.base_model is not None:
        svc.check_model(settings, body.base_model)
        base = body.base_model
    else:
        raise ApiError(400, "invalid_request", "give model_path or base_model", "model_path")
    sampler = tinker.new_model(s, session, "sampling", base, lora=None, model_path=body.model_path)
    s.commit()
    return {"type": "create_sampling_session", "sampling_session_id": sampler.id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    sampler = svc.model_of(s, tenant.id, sampler_id, kind="sampling")
    return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path}


@router.post("/asample")
def asample(body: Sample, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    if body.sampling_session_id is None:
        raise ApiError(400, "invalid_request", "sampling_session_id is required", "sampling_session_id")
    sampler = svc.model_of(s, tenant.id, body.sampling_session_id, kind="sampling")
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
    future = svc.enqueue_on_model(s, sampler, "sample", payload)
    return {**future, "sample_sequence_ids": [f"{future['request_id']}-{i}" for i in range(body.num_samples)]}


@router.post("/retrieve_future")
async def retrieve_future(
    body: RetrieveFuture, request: Request, tenant: TinkerTenantDep, db: DatabaseDep, settings: SettingsDep
) -> Response:
    state = await svc.wait_future(db, tenant.id, body.request_id, settings.tinker_long_poll_seconds)
    if state.status == "expired":
        raise ApiError(410, "gone", f"request {body.request_id} was lost with its worker; send it again")
    if state.status in ("pending", "running"):
        queue_state = "active" if state.status == "running" or state.ahead else "paused_capacity"
        reason = f"{state.ahead} requests ahead" if state.status == "pending" else "running"
        return JSONResponse(
            {
                "type": "try_again",
                "request_id": body.request_id,
                "queue_state": queue_state,
                "queue_state_reason": reason,
            },
            status_code=408,
        )
    if state.status == "failed":
        return JSONResponse({"error": state.error, "category": state.category or "server"})
    result = state.result or {}
    proto = tinker_wire.PROTOBUF in request.headers.get("accept", "")
    if state.kind in ("forward", "forward_backward"):
        if proto:
            return Response(tinker_wire.fwdbwd_output_proto(result), media_type=tinker_wire.PROTOBUF)
        return JSONResponse(tinker_wire.fwdbwd_output_json(result))
    if state.kind == "sample" and proto:
        return Response(tinker_wire.sample_output_proto(result), media_type=tinker_wire.PROTOBUF)
    return JSONResponse(result)

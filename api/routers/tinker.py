"""Tinker-compatible API (`/api/v1/...`, what the `tinker` SDK 0.38 calls): sessions, models, training and
sampling requests queued as futures for the session worker, and retrieve_future."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from api.bodies import StrictJsonRoute
from api.deps import DatabaseDep, SessionDep, SettingsDep, TinkerTenantDep
from api.services import tinker as svc
from api.services import tinker_sessions, tinker_wire
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

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=StrictJsonRoute)


def within_budget(tenant: TinkerTenantDep, s: SessionDep, settings: SettingsDep) -> None:
    """Opening a session or queueing work: 402 while the tenant's device-hour budget is spent."""
    tinker_sessions.check_budget(s, settings, tenant.id)


Budgeted = [Depends(within_budget)]


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.post("/client/config")
def client_config(_tenant: TinkerTenantDep) -> dict:
    # API keys only (no JWT exchange), uncompressed protobuf forward_backward bodies, per-request futures; a
    # spent budget (402) raises BillingError at once rather than pausing the client for up to an hour.
    return {
        "pjwt_auth_enabled": False,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "billing_exception_max_pause_duration_sec": 0,
    }


@router.post("/client/dynamic_config")
def client_dynamic_config(_tenant: TinkerTenantDep) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
async def telemetry() -> dict:
    return {"status": "accepted"}  # the SDK's telemetry is accepted and dropped


@router.get("/get_server_capabilities")
def server_capabilities(_tenant: TinkerTenantDep, settings: SettingsDep) -> dict:
    names = svc.supported_models(settings)
    return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True} for n in names]}


@router.post("/create_session", dependencies=Budgeted)
def create_session(body: CreateSession, tenant: TinkerTenantDep, s: SessionDep, settings: SettingsDep) -> dict:
    row = svc.open_session(s, settings, tenant.id, body.tags)
    return {"type": "create_session", "session_id": row.id}


@router.post("/session_heartbeat")
def session_heartbeat(body: SessionRef, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    svc.heartbeat(s, tenant.id, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/create_model", dependencies=Budgeted)
def create_model(body: CreateModel, tenant: TinkerTenantDep, s: SessionDep, settings: SettingsDep) -> dict:
    lora = body.lora_config.model_dump() if body.lora_config else None
    return svc.create_model(s, settings, tenant.id, body.session_id, body.base_model, lora, body.model_seq_id)


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
    return svc.unload_model(s, tenant.id, body.model_id)


async def _fwdbwd(request: Request, tenant_id: str, s: SessionDep, forward_only: bool) -> dict:
    headers = request.headers
    payload = tinker_wire.fwdbwd_payload(
        await request.body(), headers.get("content-type", ""), headers.get("content-encoding"), forward_only
    )
    return svc.queue_fwdbwd(s, tenant_id, payload)


@router.post("/forward_backward", dependencies=Budgeted)
async def forward_backward(request: Request, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return await _fwdbwd(request, tenant.id, s, forward_only=False)


@router.post("/forward", dependencies=Budgeted)
async def forward(request: Request, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return await _fwdbwd(request, tenant.id, s, forward_only=True)


@router.post("/optim_step", dependencies=Budgeted)
def optim_step(body: OptimStep, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    model = svc.model_of(s, tenant.id, body.model_id)
    return svc.enqueue_on_model(s, model, "optim_step", {"adam": body.adam_params.model_dump()})


@router.post("/save_weights", dependencies=Budgeted)
def save_weights(body: SaveWeights, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return svc.save_weights(s, tenant.id, body, "training")


@router.post("/save_weights_for_sampler", dependencies=Budgeted)
def save_weights_for_sampler(body: SaveWeights, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return svc.save_weights(s, tenant.id, body, "sampler")


@router.post("/load_weights", dependencies=Budgeted)
def load_weights(body: LoadWeights, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return svc.load_weights(s, tenant.id, body)


@router.post("/create_sampling_session", dependencies=Budgeted)
def create_sampling_session(
    body: CreateSamplingSession, tenant: TinkerTenantDep, s: SessionDep, settings: SettingsDep
) -> dict:
    sampler = svc.create_sampler(s, settings, tenant.id, body)
    return {"type": "create_sampling_session", "sampling_session_id": sampler.id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    sampler = svc.model_of(s, tenant.id, sampler_id, kind="sampling")
    return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path}


@router.post("/asample", dependencies=Budgeted)
def asample(body: Sample, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return svc.sample(s, tenant.id, body)


@router.post("/retrieve_future")
async def retrieve_future(
    body: RetrieveFuture, request: Request, tenant: TinkerTenantDep, db: DatabaseDep, settings: SettingsDep
) -> Response:
    state = await svc.retrieve(db, tenant.id, body.request_id, settings.tinker_long_poll_seconds)
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
    out = tinker_wire.encode_result(state.kind, state.result or {}, request.headers.get("accept", ""))
    if isinstance(out, bytes):
        return Response(out, media_type=tinker_wire.PROTOBUF)
    return JSONResponse(out)

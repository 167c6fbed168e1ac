"""Tinker sessions as a tenant's resources: the device-hour budget, finishing (deleting) a session, listing and
describing sessions, weights info by tinker path, and the SDK routes this service does not offer."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.errors import ApiError, not_found
from api.services.tinker import resolve_path
from store import tinker
from store.models import TinkerModel, TinkerSession
from store.settings import Settings
from store.usage import QueuePolicy, budget

# The SDK's finish reasons (ServiceClient.close(status)).
FINISH_STATUSES = frozenset({"success", "errored", "interrupted"})


def check_budget(s: Session, settings: Settings, tenant_id: str) -> None:
    """402 ``budget_exhausted`` (the SDK's BillingError) while the tenant's device-hour budget of this period,
    the one its jobs spend too, is used up; ``Retry-After`` is the period's end."""
    b = budget(s, QueuePolicy.of(settings), tenant_id)
    if not b.exhausted:
        return
    message = (
        f"tenant device-hour budget used ({b.used_s / 3600:.3g} of {b.budget_s / 3600:.3g} h this period) "
        f"until {b.period_end.isoformat()}"
    )
    raise ApiError(402, "budget_exhausted", message, headers={"Retry-After": str(int(b.period_end.timestamp()))})


def owned_session(s: Session, tenant_id: str, session_id: str) -> TinkerSession:
    row = tinker.owned(s, TinkerSession, session_id, tenant_id)
    if row is None:
        raise not_found("session", session_id)
    return row


def finish(s: Session, tenant_id: str, session_id: str, status: str, detail: str | None) -> None:
    """Close the session: its queued requests fail, its models are unloaded and the worker frees them. The
    first reason wins (finishing a closed session again changes nothing)."""
    row = owned_session(s, tenant_id, session_id)
    if row.status != "active":
        return
    reason = f"finished by the client ({status})" + (f": {detail}" if detail else "")
    tinker.close(s, row, reason)
    s.commit()


def list_sessions(s: Session, tenant_id: str, limit: int, offset: int) -> list[str]:
    return [row.id for row in tinker.tenant_sessions(s, tenant_id, limit, offset)]


def session_json(s: Session, tenant_id: str, session_id: str) -> dict:
    """The SDK's GetSessionResponse, with the session's state beside it."""
    summary = tinker.summarize(s, owned_session(s, tenant_id, session_id))
    return {
        "training_run_ids": summary.training_run_ids,
        "sampler_ids": summary.sampler_ids,
        "status": summary.status,
        "closed_reason": summary.closed_reason,
    }


def summaries(s: Session, tenant_id: str, limit: int) -> list[tinker.SessionSummary]:
    return [tinker.summarize(s, row) for row in tinker.tenant_sessions(s, tenant_id, limit)]


def weights_info(s: Session, tenant_id: str, path: str) -> dict:
    """The SDK's WeightsInfoResponse of one of the tenant's checkpoints."""
    ckpt = resolve_path(s, tenant_id, path, "tinker_path")
    model = s.get(TinkerModel, ckpt.model_id)
    assert model is not None  # a checkpoint's model is deleted with it
    lora = model.lora or {}
    return {
        "base_model": model.base_model,
        "is_lora": bool(lora),
        "lora_rank": lora.get("rank"),
        "train_unembed": lora.get("train_unembed"),
        "train_mlp": lora.get("train_mlp"),
        "train_attn": lora.get("train_attn"),
    }


def unsupported(what: str) -> ApiError:
    """A 400 (the SDK's BadRequestError, which it does not retry) for an SDK route this service does not offer."""
    return ApiError(400, "unsupported", f"{what} is not offered by this service (see docs/tinker.md)")

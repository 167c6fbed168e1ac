"""OpenAI's ``fine_tuning.alpha.graders.run`` and ``.validate`` over the dry run of api/services/rewards.py
(the same graders, the same per-tenant bounds), answered in OpenAI's shapes."""

from __future__ import annotations

import time
from concurrent.futures import Executor
from typing import Any

import anyio

from api.errors import ApiError
from api.limits import Limits
from api.openai_schemas import (
    GraderRunErrors,
    GraderRunIn,
    GraderRunMetadata,
    GraderRunOut,
    GraderValidateIn,
    GraderValidateOut,
)
from api.schemas import RewardRunIn
from api.services.rewards import build_checked, dry_run
from store.settings import Settings


def _param(field: str | None) -> str | None:
    """Our dry run's field as OpenAI's request names it (``reward.source`` -> ``grader.source``)."""
    if field is None:
        return None
    if field == "samples":
        return "model_sample"
    head, _, rest = field.partition(".")
    return ("grader" + (f".{rest}" if rest else "")) if head == "reward" else field


def _sub_type(grader: dict[str, Any], name: str) -> str:
    if grader.get("type") == "multi" and isinstance(grader.get("graders"), dict):
        sub = grader["graders"].get(name)
        return str(sub.get("type")) if isinstance(sub, dict) else ""
    return str(grader.get("type", ""))


def _errors(grader: dict[str, Any], errors: dict[str, str]) -> GraderRunErrors:
    """Our per-grader errors (``kind: message``) as OpenAI's error flags."""
    out = GraderRunErrors()
    for name, text in errors.items():
        kind, _, detail = text.partition(": ")
        kind_of = _sub_type(grader, name)
        if name == "calculate_output":
            out.formula_parse_error = True
        elif kind == "missing_field":
            out.invalid_variable_error = True
        elif kind_of == "python" and kind in ("exception", "invalid_output"):
            out.python_grader_runtime_error, out.python_grader_runtime_error_details = True, detail
        elif kind_of == "python":
            out.python_grader_server_error, out.python_grader_server_error_type = True, kind
        elif kind_of == "score_model" and kind == "invalid_output":
            out.model_grader_parse_error = True
        elif kind_of == "score_model":
            out.model_grader_server_error, out.model_grader_server_error_details = True, detail
        else:
            out.other_error = True
    return out


async def run(limits: Limits, pool: Executor, settings: Settings, tenant_id: str, req: GraderRunIn) -> GraderRunOut:
    """One sample graded by our dry run; ``sub_rewards``: a multi grader's sub-graders' scores."""
    start = time.monotonic()
    try:
        out = await dry_run(
            limits,
            pool,
            settings,
            tenant_id,
            RewardRunIn(reward=req.grader, item=req.item or {}, samples=[req.model_sample]),
        )
    except ApiError as exc:
        exc.field = _param(exc.field)
        raise
    result = out.results[0]
    kind = str(req.grader.get("type", ""))
    return GraderRunOut(
        reward=result.reward,
        sub_rewards=dict(result.scores) if kind == "multi" else {},
        metadata=GraderRunMetadata(
            errors=_errors(req.grader, result.errors),
            execution_time=time.monotonic() - start,
            name=str(req.grader.get("name") or kind),
            scores=dict(result.scores),
            type=kind,
        ),
    )


def _check(grader: dict[str, Any], settings: Settings) -> None:
    build_checked(grader, settings).close()


async def validate(settings: Settings, req: GraderValidateIn) -> GraderValidateOut:
    """The grader as given when it builds; 400 naming its bad field otherwise."""
    try:
        await anyio.to_thread.run_sync(_check, req.grader, settings)
    except ApiError as exc:
        exc.field = _param(exc.field)
        raise
    return GraderValidateOut(grader=req.grader)

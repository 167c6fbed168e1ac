"""A job submission's checks at the API: hyperparameters, grader spec, tools, model, files, limits; each a 422
(or 404) naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.services.rewards import build_checked
from gspo_core.agents.tools import ToolSpecError, build_toolbox
from gspo_core.config import GSPOConfig, Resources
from gspo_core.data import DataError, check_row_tools, check_sft_file, rows_with_tools
from gspo_core.rewards import GraderPolicy
from store.model_refs import ModelRefError, check_local_or_hub
from store.models import Checkpoint, File, Tenant
from store.objects import ObjectStore
from store.settings import Settings


def check_hyperparameters(raw: dict[str, Any]) -> GSPOConfig:
    try:
        return GSPOConfig(**raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        field = f"hyperparameters.{loc}" if loc else "hyperparameters"
        raise ApiError(422, "invalid_hyperparameters", f"{field}: {err['msg']}", field) from None


def check_reward(spec: dict[str, Any], fields: set[str] | None, settings: Settings) -> None:
    """The spec builds, its grader models are allowed, and every ``{{item.x}}`` it uses exists in the
    training file."""
    fn = build_checked(spec, settings)
    try:
        missing = sorted(fn.item_fields() - fields) if fields is not None else []
    finally:
        fn.close()
    if missing:
        raise ApiError(
            422,
            "invalid_reward",
            f"reward uses item field(s) {', '.join(missing)} that the training file's rows do not all have",
            "reward",
        )


def check_tools(
    tools: list[dict[str, Any]], settings: Settings, objects: ObjectStore, files: dict[str, File | None]
) -> None:
    """The tools build under the operator's grader policy (sandbox, egress; MCP servers are not contacted
    here: their tools are listed when the job starts); every tool the files' rows name is one of them
    (unless an MCP server's may be). 422 naming the field (and the file's line)."""
    try:
        box = build_toolbox(tools, GraderPolicy.from_mapping(settings.grader_policy()), connect=False)
    except ToolSpecError as exc:
        raise ApiError(422, "invalid_tools", str(exc), exc.field) from None
    names = set(box.tools) if box is not None else set()
    if box is not None:
        box.close()
    if any(tool.get("type") == "mcp" for tool in tools):
        return  # the rows' names are checked against the servers' lists when the job starts
    for field, f in files.items():
        if f is None:
            continue
        try:
            check_row_tools(rows_with_tools(objects.open_stream(f.object_key)), names)
        except DataError as exc:
            raise ApiError(
                422, "invalid_file", f"{field}: line {exc.line}: {exc.message}", f"{field}.{exc.field}", line=exc.line
            ) from None


def check_model(s: Session, settings: Settings, tenant: Tenant, model: str) -> None:
    """A checkpoint of this tenant, a directory under models_dir, or a hub id when allowed."""
    if model.startswith("ckpt:"):
        ckpt = s.get(Checkpoint, model[5:])
        if ckpt is None or ckpt.tenant_id != tenant.id:
            raise ApiError(404, "not_found", f"checkpoint {model[5:]} not found", "model")
        return
    try:
        check_local_or_hub(settings, model)
    except ModelRefError as exc:
        hint = ", or ckpt:<checkpoint id>" if str(exc).startswith("unknown model") else ""
        raise ApiError(422, "invalid_model", f"{exc}{hint}", "model") from None


def check_wall_limit(asked: int | None, settings: Settings) -> None:
    """A job may ask for less device time than the operator allows, not more."""
    limit = settings.max_job_wall_seconds
    if asked is not None and limit and asked > limit:
        raise ApiError(
            422,
            "invalid_max_wall_seconds",
            f"max_wall_seconds: at most {limit:.0f} (the operator's limit per job)",
            "max_wall_seconds",
        )


def check_supervised(reward: dict[str, Any] | None, objects: ObjectStore, files: dict[str, File | None]) -> None:
    """A supervised job takes no grader, and every row of its files is a chat row it can train on (a 422
    naming the file, the line and the field of the first that is not)."""
    if reward:
        raise ApiError(422, "invalid_reward", "reward: a supervised job takes no grader", "reward")
    for field, f in files.items():
        if f is None:
            continue
        try:
            check_sft_file(objects.open_stream(f.object_key))  # a line at a time, never the file
        except DataError as exc:
            where = f"{field}: line {exc.line}: " if exc.line else f"{field}: "
            raise ApiError(
                422,
                "invalid_file",
                f"{where}{exc.message} (a supervised row)",
                f"{field}.{exc.field or 'messages'}",
                line=exc.line,
            ) from None


def check_resources(asked: Resources, settings: Settings) -> None:
    """A job may ask for at most the devices of the operator's largest worker."""
    if asked.devices > settings.max_job_devices:
        raise ApiError(
            422,
            "invalid_resources",
            f"resources.devices: at most {settings.max_job_devices} (the operator's GSPO_MAX_JOB_DEVICES)",
            "resources.devices",
        )


def owned_file(s: Session, tenant: Tenant, file_id: str, field: str) -> File:
    f = s.get(File, file_id)
    if f is None or f.tenant_id != tenant.id:
        raise ApiError(404, "not_found", f"file {file_id} not found", field)
    if f.purpose != "fine-tune":
        raise ApiError(422, "invalid_file", f"file {file_id} is a job's results ({f.purpose}), not a dataset", field)
    return f

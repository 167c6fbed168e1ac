"""A job's environment at the API: checked at submission (422 naming the field), and its first items shown; the
tasks' generators run in the grader pool within GSPO_ENVIRONMENT_CHECK_TIMEOUT_S, never in a request's thread."""

from __future__ import annotations

from typing import Any

from api.errors import ApiError
from api.job_schemas import EnvironmentOut, JobCreate
from gspo_core.config import GSPOConfig
from gspo_core.environments import (
    Environment,
    EnvironmentSpecError,
    VerifiersEnvironment,
    check_environment,
    default_reward,
    environment_preview,
    parse_environment,
)
from gspo_core.environments.isolated import EnvironmentBusy, Isolation
from gspo_core.environments.verifiers_env import check_allowed
from gspo_core.rewards import GraderPolicy, redact_secrets
from store.models import Job
from store.settings import Settings


def isolation(settings: Settings) -> Isolation:
    """The API's generators: in its grader pool at the dry runs' priority, within the check's time."""
    policy = GraderPolicy.from_mapping({**settings.grader_policy(), "niceness": settings.dry_run_niceness})
    return Isolation(policy, settings.environment_check_timeout_s, "GSPO_ENVIRONMENT_CHECK_TIMEOUT_S")


def _busy(exc: EnvironmentBusy) -> ApiError:
    return ApiError(503, "busy", f"{exc}; retry shortly", "environment", headers={"Retry-After": "5"})


def check_environment_job(
    req: JobCreate, cfg: GSPOConfig, settings: Settings
) -> tuple[Environment | None, dict[str, Any] | None]:
    """``(environment, reward)`` of the request: its environment checked (422 naming the field, listing the
    known names), files or an environment but not both, and the environment's own reward where none is given."""
    if req.environment is None:
        if req.training_file is None:
            raise ApiError(
                422, "invalid_request", "training_file: required unless an environment is given", "training_file"
            )
        return None, req.reward
    for field in ("training_file", "validation_file"):
        if getattr(req, field) is not None:
            raise ApiError(
                422,
                "invalid_request",
                f"{field}: give files or an environment, not both (the environment makes its own held-out split)",
                field,
            )
    if cfg.method == "supervised":
        raise ApiError(422, "invalid_environment", "environment: a supervised job trains on files", "environment")
    try:
        parsed = parse_environment(req.environment)
        if isinstance(parsed, VerifiersEnvironment):  # only what the operator installed and allowed
            check_allowed(parsed, settings.allowed_verifiers())
        if parsed.size > settings.max_file_rows:  # before any generator runs
            raise EnvironmentSpecError(
                "environment.size", f"at most {settings.max_file_rows} (the operator's GSPO_MAX_FILE_ROWS)"
            )
        env = check_environment(
            req.environment,
            isolation(settings),
            settings.max_row_bytes,
            egress_allow=settings.grader_policy()["egress_allow"],
        )
    except EnvironmentSpecError as exc:
        raise ApiError(422, "invalid_environment", str(exc), exc.field) from None
    except EnvironmentBusy as exc:
        raise _busy(exc) from None
    if env.type == "openenv" and req.tools:
        raise ApiError(
            422, "invalid_environment", "tools: an openenv environment answers the model itself: give no tools", "tools"
        )
    return env, req.reward or default_reward(env.type)


def environment_out(job: Job, samples: int, settings: Settings) -> EnvironmentOut:
    """The job's environment and its first ``samples`` training items; 404 for a job trained on files, 422 naming
    ``samples`` when they do not generate within the time."""
    if job.environment is None:
        raise ApiError(404, "not_found", f"job {job.id} trains on files, not an environment", "job_id")
    env = parse_environment(job.environment)
    try:
        rows = environment_preview(env, samples, isolation(settings)) if samples else []
    except EnvironmentSpecError as exc:
        raise ApiError(422, "invalid_environment", f"samples: {exc.message}; ask for fewer", "samples") from None
    except EnvironmentBusy as exc:
        raise _busy(exc) from None
    return EnvironmentOut(environment=redact_secrets(job.environment), samples=rows)

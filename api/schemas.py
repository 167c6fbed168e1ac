"""Pydantic request/response schemas of the API (separate from the SQLAlchemy tables)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.json_schema import JsonDict

from gspo_core.agents.tools_schema import tool_entry_schema
from gspo_core.config import GSPOConfig, Resources

if TYPE_CHECKING:
    from fastapi.responses import Response

T = TypeVar("T")


def as_utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes (stored as UTC); RFC 3339 needs the offset spelled out."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


UtcDatetime = Annotated[datetime, AfterValidator(as_utc)]
EXAMPLE_REWARD: JsonDict = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
JobStatus = Literal["queued", "running", "cancelling", "pausing", "paused", "succeeded", "failed", "cancelled"]


def json_response(model: BaseModel, status_code: int = 200) -> Response:
    """The model as a JSON response, serialized once. For hot read endpoints: FastAPI would dump a
    returned model to a dict, validate it again against ``response_model`` and then serialize it
    (measured: about a third of a metrics poll). Use only with a model of the declared type."""
    from fastapi.responses import Response

    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None
    line: int | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route that answers ``codes`` with the error body."""
    return {code: {"model": ErrorBody} for code in codes}


class HealthOut(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyOut(BaseModel):
    """``GET /readyz``: 200 when the database and the broker answer, else 503 with the same body. A missing
    worker is reported, not a 503: the API still serves (jobs wait), and an API deployed apart from its
    workers must stay in its load balancer."""

    database: Literal["ok", "unreachable"]
    broker: Literal["ok", "unreachable"]
    sandbox: str = Field(description="How python graders run: bubblewrap (isolated), weak (rlimits only) or refused")
    sandbox_reason: str | None = Field(None, description="Why python graders are not isolated by bubblewrap")
    worker: Literal["ok", "missing"] = Field(
        "ok", description="Whether a worker is alive to run jobs (missing: queued jobs wait until one starts)"
    )
    workers: int = Field(0, description="Workers whose beat is recent")


class Page(BaseModel, Generic[T]):
    data: list[T]
    next_cursor: str | None = None


class FileOut(BaseModel):
    """A file: OpenAI's file object (``created_at`` in Unix seconds, ``purpose``, ``status``) plus ``rows``
    and ``item_fields``."""

    id: str
    object: Literal["file"] = "file"
    filename: str
    bytes: int
    rows: int
    item_fields: list[str]
    created_at: int = Field(description="Unix time (seconds) of the upload")
    purpose: Literal["fine-tune", "fine-tune-results"] = Field(
        default="fine-tune", description="fine-tune: an uploaded dataset; fine-tune-results: a job's metrics CSV"
    )
    status: Literal["processed"] = Field(
        default="processed", description="Always processed: files are validated at upload"
    )


class FilePage(Page[FileOut]):
    """``GET /v1/files``: newest first; OpenAI's list fields (``object``, ``has_more``) with ours."""

    object: Literal["list"] = "list"
    has_more: bool = False


def hyperparameters_schema() -> dict[str, Any]:
    """GSPOConfig's JSON schema, each field with its description and bounds; every field is optional (an
    absent one takes its default). The request's values are checked by GSPOConfig itself
    (api/services/jobs.py), whose 422 names the field as ``hyperparameters.<name>``."""
    schema = GSPOConfig.model_json_schema()
    schema.pop("required", None)
    return {**schema, "title": "Hyperparameters"}


def inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its ``$defs`` written in place: embedded in a request's schema, pydantic's
    ``#/$defs/...`` references would point at the OpenAPI document's root, where they are not."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: walk(value) for key, value in node.items()}
        return [walk(value) for value in node] if isinstance(node, list) else node

    return walk(schema)


def environment_schema() -> dict[str, Any]:
    """The environment's JSON schema: one of its types, by ``type`` (checked by gspo_core.environments, whose 422
    names the field as ``environment.<path>``)."""
    from gspo_core.environments import ENVIRONMENT_TYPES

    types = [inlined(model.model_json_schema()) for model in ENVIRONMENT_TYPES.values()]
    return {"anyOf": [*types, {"type": "null"}]}


class JobUsage(BaseModel):
    """What the job used so far, over all its attempts (re-run steps after a resume count again)."""

    device_seconds: float = Field(description="Wall time the job held a worker's device")
    tokens_sampled: int = Field(description="Completion tokens sampled")
    tokens_trained: int = Field(description="Prompt + completion tokens of the rows the updates trained on")


class EvaluationPoint(BaseModel):
    """One held-out evaluation: the mean reward of greedy completions (greedy accuracy for 0/1 rewards) and of
    sampled ones; a supervised job's held-out loss instead."""

    step: int
    prompts: int
    greedy_reward: float | None = None
    sampled_reward: float | None = None
    loss: float | None = None


class JobEvaluation(BaseModel):
    """The held-out evaluation before the first step and after the last (null until it ran)."""

    before: EvaluationPoint | None = None
    after: EvaluationPoint | None = None


class JobCreate(BaseModel):
    """``POST /v1/jobs``. ``hyperparameters`` are gspo_core's GSPOConfig fields (unknown = 422)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "model": "Qwen/Qwen2.5-0.5B-Instruct",
                    "training_file": "file_0123456789abcdef01234567",
                    "reward": EXAMPLE_REWARD,
                    "hyperparameters": {"steps": 20, "group_size": 8},
                    "name": "exact-answers",
                    "metadata": {"team": "rl"},
                    "seed": 1,
                }
            ]
        },
    )

    model: str = Field(
        ...,
        min_length=1,
        max_length=512,
        description="HF id (org/name), a directory under the models dir, or ckpt:<id>.",
    )
    training_file: str | None = Field(None, min_length=1, max_length=64, description="Required unless `environment`.")
    validation_file: str | None = Field(None, max_length=64)
    environment: Annotated[dict[str, Any] | None, WithJsonSchema(environment_schema())] = Field(
        None,
        description="Instead of files: where prompts and rewards come from, by `type` (docs/environments.md). "
        "reasoning_gym: procedural tasks by name, a held-out split generated beside them, and each task's own "
        "scorer as the default reward. openenv: a tenant's OpenEnv server (its address under the egress policy, "
        "its headers redacted in answers) plays each episode; its rewards are the episode's.",
    )
    reward: dict[str, Any] | None = Field(
        None,
        description="Grader spec (see README: reward spec); required unless hyperparameters.method is supervised "
        "or an environment gives its own.",
    )
    tools: Annotated[
        list[dict[str, Any]], WithJsonSchema({"type": "array", "items": tool_entry_schema(), "maxItems": 64})
    ] = Field(
        default_factory=list,
        max_length=64,
        description="Tools the model may call during its rollouts (docs/agents.md): "
        '{"type": "python", "source"} or {"type": "http", "name", "description", "parameters", "server_url", '
        '"headers"}; with hyperparameters.max_turns > 1.',
    )
    hyperparameters: Annotated[dict[str, Any], WithJsonSchema(hyperparameters_schema())] = Field(
        default_factory=dict,
        description="The algorithm's settings (GSPOConfig); how the machine runs the job "
        "(rollout engine, memory) is the operator's, not the job's.",
    )
    name: str | None = Field(None, max_length=200)
    metadata: dict[str, str] = Field(default_factory=dict, max_length=32)
    seed: int = Field(0, ge=0, le=2**31 - 1, strict=True)  # strict: `true` is not a seed
    resources: Resources = Field(
        default_factory=Resources,
        description="What the job runs on: devices (trainer ranks), 1 up to the operator's GSPO_MAX_JOB_DEVICES.",
    )
    max_wall_seconds: int | None = Field(
        None,
        gt=0,
        le=2**31 - 1,
        strict=True,
        description=(
            "Device time (seconds, summed over attempts) at which the job stops (within seconds, dropping the "
            "step in flight), checkpoints its last completed step and fails; at most the operator's limit, "
            "which applies when unset."
        ),
    )


class JobOut(BaseModel):
    id: str
    object: Literal["job"] = "job"
    name: str | None
    model: str
    status: JobStatus
    step: int
    total_steps: int
    queue_position: int | None = Field(
        description="While queued: its place among this tenant's own queued jobs (1: the tenant's next)"
    )
    waiting_reason: str | None = Field(None, description="While queued: why it has not started")
    error: str | None
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    training_file: str | None  # null once the file was deleted (after the job finished), or for an environment
    validation_file: str | None
    environment: dict[str, Any] | None = Field(
        None, description="Where prompts come from instead of files (credentials redacted)"
    )
    reward: dict[str, Any]
    tools: list[dict[str, Any]] = Field(default_factory=list, description="The job's tools (credentials redacted)")
    hyperparameters: dict[str, Any]
    metadata: dict[str, Any]
    seed: int
    attempts: int
    max_wall_seconds: int | None = None
    resources: Resources = Field(default_factory=Resources)
    usage: JobUsage
    latest_metrics: dict[str, float] | None
    evaluation: JobEvaluation = Field(
        default_factory=JobEvaluation,
        description="Held-out evaluation before the first step and after the last (jobs with a validation set)",
    )


class EnvironmentOut(BaseModel):
    """``GET /v1/jobs/{id}/environment``: the job's environment and its first training items."""

    object: Literal["environment"] = "environment"
    environment: dict[str, Any]
    samples: list[dict[str, Any]] = Field(description="The first training items, as the job's rows are")


class UsagePeriod(BaseModel):
    period_start: UtcDatetime
    period_end: UtcDatetime
    device_seconds: float
    tokens_sampled: int
    tokens_trained: int
    jobs: int = Field(description="Jobs that ran in the period")


class UsageTotals(BaseModel):
    device_seconds: float
    tokens_sampled: int
    tokens_trained: int
    jobs: int


class UsageOut(BaseModel):
    """``GET /v1/usage``: the tenant's usage per budget period (newest first) and its budget."""

    object: Literal["usage"] = "usage"
    period_seconds: int
    budget_device_hours: float | None = Field(description="Device hours per period; null: no budget")
    current: UsagePeriod
    budget_left_device_hours: float | None
    budget_exhausted_until: UtcDatetime | None = Field(
        description="While the budget of the current period is used: when queued jobs may start again"
    )
    periods: list[UsagePeriod]
    total: UsageTotals


class StepMetricsOut(BaseModel):
    step: int
    metrics: dict[str, float]
    created_at: UtcDatetime


class SamplesOut(BaseModel):
    step: int
    rows: list[dict[str, Any]]
    steps_available: list[int]


class CheckpointOut(BaseModel):
    id: str
    object: Literal["checkpoint"] = "checkpoint"
    job_id: str
    step: int
    size_bytes: int
    final: bool
    metrics: dict[str, float]
    created_at: UtcDatetime
    download_url: str


class RewardRunIn(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"reward": EXAMPLE_REWARD, "item": {"prompt": "2+2=", "answer": "4"}, "samples": ["4", "5"]}]
        },
    )

    reward: dict[str, Any]
    item: dict[str, Any] = Field(default_factory=dict)
    samples: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Completion texts to grade (GSPO_MAX_REWARD_RUN_SAMPLES, at most 64); or give `messages`.",
    )
    messages: list[dict[str, Any]] | None = Field(
        None,
        description="Instead of `samples`: one episode's chat transcript (assistant `tool_calls`, `tool` "
        "results), graded as training grades it: `output_text` its last assistant text, `output_tools` its "
        "calls, `messages` the transcript.",
    )


class RewardRunResult(BaseModel):
    output_text: str
    reward: float
    scores: dict[str, float]
    errors: dict[str, str]


class RewardRunOut(BaseModel):
    results: list[RewardRunResult]
    grader_names: list[str]


WebhookEvent = Literal["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]


class WebhookCreate(BaseModel):
    """``POST /v1/webhooks``: where to send which job events."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        max_length=2048,
        description="http(s) URL; private, loopback and metadata addresses only where the operator allows them",
    )
    events: list[WebhookEvent] | None = Field(None, min_length=1, max_length=3, description="Default: all three")
    name: str | None = Field(None, max_length=200)


class WebhookOut(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    name: str | None = None
    events: list[WebhookEvent]
    created_at: int = Field(description="Unix time (seconds)")


class WebhookCreated(WebhookOut):
    secret: str = Field(description="The Standard Webhooks signing secret (whsec_...): shown only in this answer")


class WebhookList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookOut]


class DeliveryAttempt(BaseModel):
    at: int = Field(description="Unix time (seconds) the attempt ended")
    status_code: int | None = Field(description="The receiver's HTTP status; null when no answer came")
    error: str | None = Field(description="What failed (never the receiver's body); null on a 2xx")
    duration_ms: int


class WebhookDeliveryOut(BaseModel):
    """One event sent to one endpoint: ``id`` is the ``webhook-id`` header, the same on every attempt."""

    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    endpoint_id: str
    event_id: str
    event_type: WebhookEvent
    job_id: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None
    last_error: str | None
    next_attempt_at: int | None = Field(description="Unix time of the next attempt; null once delivered or failed")
    created_at: int
    finished_at: int | None
    history: list[DeliveryAttempt]


class WebhookDeliveryPage(BaseModel):
    """Newest first; the next page with ``after=<last id>``."""

    object: Literal["list"] = "list"
    data: list[WebhookDeliveryOut]
    has_more: bool = False

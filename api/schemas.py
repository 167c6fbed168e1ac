"""Pydantic request/response schemas of the API shared by its resources, and of files, usage, reward runs and webhooks
(a job's own: api/job_schemas.py; both separate from the SQLAlchemy tables)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonDict

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

"""OpenAI's fine-tuning shapes (``/v1/fine_tuning/...``), as its official SDK reads and sends them."""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from api.job_schemas import hyperparameters_schema
from api.schemas import EXAMPLE_REWARD
from gspo_core.agents.tools_schema import openai_tool_schema

T = TypeVar("T")
#: The largest value any of OpenAI's hyperparameters takes (each GSPOConfig field it sets has its own, smaller
#: bound, whose error names the key); checked before any conversion, so every product stays finite.
MAX_HYPERPARAMETER = 1_000_000
#: OpenAI's hyperparameters: JSON type and what each sets (api/services/openai_hparams.py maps them).
OPENAI_HYPERPARAMETERS = {
    "batch_size": ("integer", "Rows per step (prompts_per_step)"),
    "n_epochs": ("integer", "Passes over the training file (sets steps)"),
    "learning_rate_multiplier": ("number", "Times the default learning rate"),
    "eval_interval": ("integer", "Steps between evaluations (eval_every)"),
    "eval_samples": ("integer", "Validation prompts per evaluation (eval_prompts)"),
    "compute_multiplier": ("number", "Times the default group size (group_size)"),
    "max_episode_steps": ("integer", "Agent RFT: model turns of an episode (max_turns)"),
}
SUPERVISED_HYPERPARAMETERS = ("batch_size", "learning_rate_multiplier", "n_epochs")


def openai_hyperparameters_schema(keys: tuple[str, ...], reasoning: bool) -> dict[str, Any]:
    """OpenAI's ``keys`` (each "auto" or a bounded number) with GSPOConfig's fields as extensions."""
    native = hyperparameters_schema()
    props: dict[str, Any] = {
        key: {
            "anyOf": [
                {"const": "auto"},
                {"type": kind, "exclusiveMinimum": 0, "maximum": MAX_HYPERPARAMETER},
            ],
            "default": "auto",
            "description": what,
        }
        for key, (kind, what) in OPENAI_HYPERPARAMETERS.items()
        if key in keys
    }
    if reasoning:
        props["reasoning_effort"] = {"enum": ["auto", "default"], "default": "auto"}
    return {**native, "title": "OpenAI hyperparameters", "properties": {**props, **native["properties"]}}


OpenAIStatus = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


def openai_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of an OpenAI-shaped route that answers ``codes`` with OpenAI's error body."""
    return {code: {"model": OpenAIErrorBody} for code in codes}


class ListOut(BaseModel, Generic[T]):
    """OpenAI's cursor page: the next page is ``?after=<last id>`` while ``has_more``."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class ReinforcementIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: dict[str, Any] = Field(
        description="OpenAI's grader: string_check, text_similarity, python, score_model, multi"
    )
    hyperparameters: Annotated[
        dict[str, Any], WithJsonSchema(openai_hyperparameters_schema(tuple(OPENAI_HYPERPARAMETERS), True))
    ] = Field(
        default_factory=dict,
        description="OpenAI's (batch_size, n_epochs, learning_rate_multiplier, eval_interval, eval_samples, "
        "compute_multiplier, reasoning_effort; each 'auto' or a value) and, as extensions, GSPOConfig's fields",
    )
    response_format: dict[str, Any] | None = Field(
        None,
        description="{'type': 'json_schema', 'json_schema': {'name', 'schema', 'strict'}}: graders read the "
        "answer as sample.output_json; decoding is not constrained (docs/openai.md)",
    )
    tools: Annotated[
        list[dict[str, Any]] | None,
        WithJsonSchema({"anyOf": [{"type": "array", "items": openai_tool_schema(), "maxItems": 64}, {"type": "null"}]}),
    ] = Field(
        None,
        max_length=64,
        description="Agent RFT's tools, {name, server_url, headers} (and optionally description, parameters): "
        "endpoints the model calls during its episodes, run as native http tools (docs/agents.md); the turns "
        "are hyperparameters.max_episode_steps",
    )


class SupervisedIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hyperparameters: Annotated[
        dict[str, Any], WithJsonSchema(openai_hyperparameters_schema(SUPERVISED_HYPERPARAMETERS, False))
    ] = Field(
        default_factory=dict,
        description="OpenAI's (batch_size, n_epochs, learning_rate_multiplier; each 'auto' or a value) and, as "
        "extensions, GSPOConfig's fields",
    )


class MethodIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str = Field(max_length=64, description="reinforcement or supervised (dpo is not built)")
    reinforcement: ReinforcementIn | None = None
    supervised: SupervisedIn | None = None
    dpo: dict[str, Any] | None = None


class FineTuningJobCreate(BaseModel):
    """``client.fine_tuning.jobs.create(...)``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "model": "Qwen/Qwen2.5-0.5B-Instruct",
                    "training_file": "file_0123456789abcdef01234567",
                    "method": {
                        "type": "reinforcement",
                        "reinforcement": {"grader": EXAMPLE_REWARD},
                    },
                    "seed": 1,
                }
            ]
        },
    )

    model: str = Field(min_length=1, max_length=512)
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(None, max_length=64)
    suffix: str | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**31 - 1, strict=True)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    method: MethodIn | None = None
    hyperparameters: dict[str, Any] | None = Field(None, description="Deprecated by OpenAI (supervised only)")
    integrations: list[dict[str, Any]] | None = None


class FineTuningJobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJob(BaseModel):
    """OpenAI's ``fine_tuning.job``; ``gspo_*``, ``step`` and ``total_steps`` are this service's extras."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    model: str
    fine_tuned_model: str | None = Field(description="ckpt:<id> of the final checkpoint: a `model` a new job takes")
    organization_id: str
    status: OpenAIStatus
    created_at: int
    finished_at: int | None
    estimated_finish: int | None
    trained_tokens: int | None
    error: FineTuningJobError | None
    result_files: list[str]
    seed: int
    suffix: str | None
    metadata: dict[str, str]
    method: dict[str, Any]
    hyperparameters: dict[str, Any]
    training_file: str | None
    validation_file: str | None
    integrations: list[dict[str, Any]] = Field(default_factory=list)
    step: int
    total_steps: int
    gspo_status: str = Field(description="This service's own status (e.g. cancelling)")
    gspo_hyperparameters: dict[str, Any] = Field(description="The GSPOConfig the job runs with")


class FineTuningJobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"]
    data: dict[str, Any] | None = None


class FineTuningJobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str = Field(description="ckpt:<id>: a `model` a new job takes")
    fine_tuning_job_id: str
    step_number: int
    metrics: dict[str, Any]
    download_url: str


class GraderRunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: dict[str, Any]
    model_sample: str = Field(max_length=1_000_000)
    item: dict[str, Any] | None = None


class GraderValidateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: dict[str, Any]


class GraderRunErrors(BaseModel):
    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False


class GraderRunMetadata(BaseModel):
    errors: GraderRunErrors
    execution_time: float
    name: str
    sampled_model_name: str | None = None
    scores: dict[str, Any]
    token_usage: int | None = None
    type: str


class GraderRunOut(BaseModel):
    reward: float
    sub_rewards: dict[str, Any]
    metadata: GraderRunMetadata
    model_grader_token_usage_per_model: dict[str, Any] = Field(default_factory=dict)


class GraderValidateOut(BaseModel):
    grader: dict[str, Any]


class WebhookEndpointCreate(BaseModel):
    """``client.webhooks.create``: ``event_types`` among the fine-tuning events this service sends."""

    model_config = ConfigDict(extra="forbid")

    event_types: list[str] = Field(min_length=1, max_length=3)
    name: str = Field(max_length=200)
    url: str = Field(max_length=2048)


class WebhookEndpointUpdate(BaseModel):
    """``client.webhooks.update``: what is given is set (``event_types`` is the complete new set)."""

    model_config = ConfigDict(extra="forbid")

    event_types: list[str] | None = Field(None, min_length=1, max_length=3)
    name: str | None = Field(None, max_length=200)
    url: str | None = Field(None, max_length=2048)


class WebhookRotateSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_old_secret_active_for_24_hours: bool = False


class WebhookTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    event_type: str = Field(max_length=100)


class WebhookEndpointTestResult(BaseModel):
    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    webhook_endpoint_id: str
    event_type: str
    status_code: int = Field(description="The endpoint's answer (0: no answer, see `error`)")
    success: bool = Field(description="Whether the endpoint answered with a 2xx")
    error: str | None = Field(None, description="Why there was no 2xx (an extension of OpenAI's object)")


class WebhookEndpoint(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    created_at: int
    updated_at: int
    event_types: list[str]
    name: str
    url: str
    signing_secret_hint: str = Field(description="The secret's last four characters")


class WebhookEndpointWithSecret(WebhookEndpoint):
    signing_secret: str = Field(description="Shown only when the endpoint is created or its secret rotated")


class DeletedWebhookEndpoint(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True

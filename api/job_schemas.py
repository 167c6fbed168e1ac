"""Pydantic schemas of a job and what hangs off it: the request, the job, its environment, metrics, samples and
checkpoints (the API's shared types: api/schemas.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from api.schemas import EXAMPLE_REWARD, UtcDatetime
from gspo_core.agents.tools_schema import tool_entry_schema
from gspo_core.config import GSPOConfig, Resources

JobStatus = Literal["queued", "running", "cancelling", "pausing", "paused", "succeeded", "failed", "cancelled"]


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
        "its headers redacted in answers) plays each episode; its rewards are the episode's. verifiers: an "
        "operator-allowed verifiers environment, its rollouts against the job's own endpoint, its rubric the reward.",
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

"""The environment specs a job may give (their shapes and bounds; OpenAPI shows their descriptions)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: What a reasoning_gym item asks the model to do with its answer (the grader reads ``<answer>`` tags first).
DEFAULT_SYSTEM_PROMPT = (
    "Solve the problem. Give only the final answer between <answer> and </answer> tags, e.g. <answer>42</answer>."
)
#: The fields of every reasoning_gym item: ``messages`` (the chat prompt), the task's ``question``, ``answer``
#: and ``metadata``, the ``task`` name and its ``task_config`` (what its scorer is built with).
ITEM_FIELDS = ("messages", "question", "answer", "metadata", "task", "task_config")


class ReasoningGymTask(BaseModel):
    """One reasoning-gym task by name, its share of the items and its generator's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., min_length=1, max_length=100, description="A reasoning-gym dataset name, e.g. chain_sum.")
    weight: float = Field(1.0, gt=0.0, le=1e6, description="Relative share of the items drawn from this task.")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's own config fields (its reasoning-gym config dataclass, e.g. min_terms); seed and "
        "size are the environment's.",
    )


class ReasoningGymEnvironment(BaseModel):
    """Procedural tasks by name (PyPI ``reasoning-gym``): ``size`` training items generated from ``seed``, and a
    held-out split of up to ``validation_size`` items generated from a seed derived from it, less any item
    whose question is also a training question."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["reasoning_gym"]
    tasks: list[ReasoningGymTask] = Field(..., min_length=1, max_length=32)
    seed: int = Field(0, ge=0, le=2**31 - 1, strict=True, description="Seeds the generated items.")
    size: int = Field(1000, ge=1, le=100_000, strict=True, description="Training items generated.")
    validation_size: int = Field(
        64,
        ge=0,
        le=10_000,
        strict=True,
        description="Held-out items (disjoint from the training items by question); 0 = none.",
    )
    system_prompt: str | None = Field(
        DEFAULT_SYSTEM_PROMPT,
        max_length=8000,
        description="The system message before each question (null: the question alone).",
    )

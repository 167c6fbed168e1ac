"""A ``verifiers`` environment's spec and the operator's allow-list, checked without the library (the worker's
episodes: `gspo_core.environments.verifiers_episodes`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: The fields of every row of a verifiers environment (what graders may name as ``{{item.x}}``).
VERIFIERS_ITEM_FIELDS = ("messages", "task", "answer", "info")
#: verifiers' own taskset settings, which every taskset has and a tenant never sets: ``task`` plugs functions in
#: by import path or file (code the worker would run), ``system_prompt`` reads a file of the worker's.
FRAMEWORK_ARGS = frozenset({"id", "task", "system_prompt"})


class VerifiersEnvironment(BaseModel):
    """An environment package of PrimeIntellect's ``verifiers`` (its task-centric contract: a ``Taskset`` whose
    tasks score themselves with ``@vf.reward``) that the operator installed and allowed by id."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["verifiers"]
    id: str = Field(
        ...,
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="The environment's id (its taskset id), one of the operator's GSPO_VERIFIERS_ENVIRONMENTS.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="The taskset's own config fields (JSON values), e.g. a split or a size."
    )
    size: int = Field(1000, ge=1, le=100_000, strict=True, description="At most this many tasks train.")
    validation_size: int = Field(
        0, ge=0, le=10_000, strict=True, description="Tasks after the training ones held out for evaluation."
    )
    timeout_s: float = Field(300.0, ge=1.0, le=3600.0, description="One episode's wall-clock limit.")

    @field_validator("args")
    @classmethod
    def _own_fields_only(cls, args: dict[str, Any]) -> dict[str, Any]:
        if bad := sorted(set(args) & FRAMEWORK_ARGS):
            raise ValueError(f"{bad[0]!r} is verifiers' own setting, not one of the environment's config fields")
        return args


def check_allowed(env: VerifiersEnvironment, allowed: Collection[str]) -> None:
    """Refuse an id the operator did not allow (:class:`EnvironmentSpecError` on ``environment.id``)."""
    from gspo_core.environments import EnvironmentSpecError

    if env.id not in allowed:
        known = ", ".join(sorted(allowed)) or "none: the operator allowed no verifiers environment"
        raise EnvironmentSpecError("environment.id", f"{env.id!r} is not an allowed environment (allowed: {known})")


def verifiers_spec(raw: object) -> VerifiersEnvironment | None:
    """A job's ``environment`` as a verifiers spec, or None when it names another type (or none)."""
    if not isinstance(raw, dict) or raw.get("type") != "verifiers":
        return None
    return VerifiersEnvironment.model_validate(raw)

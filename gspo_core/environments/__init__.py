"""A job's environment: where its prompts and rewards come from when it names one instead of a dataset.

One field, ``environment``, with a ``type`` discriminator. ``reasoning_gym`` (procedural tasks by name) and
``verifiers`` (an operator-allowed environment package, run in its own venv) are built; ``openenv`` is planned
as a further type of the same field (docs/environments.md).
An environment of a dataset-like type yields the same item dicts a JSONL file would (:func:`environment_rows`),
so the rest of the loop is unchanged. Validating a spec imports no torch; a type's library is imported only
when the spec names that type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from pydantic import BaseModel, ValidationError

from gspo_core.environments.spec import (
    DEFAULT_SYSTEM_PROMPT,
    ITEM_FIELDS,
    ReasoningGymEnvironment,
    ReasoningGymTask,
)
from gspo_core.environments.verifiers_env import VERIFIERS_ITEM_FIELDS, VerifiersEnvironment

#: A job's environment, of any built type.
AnyEnvironment = ReasoningGymEnvironment | VerifiersEnvironment

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ENVIRONMENT_TYPES",
    "PLANNED_TYPES",
    "AnyEnvironment",
    "EnvironmentSpecError",
    "ReasoningGymEnvironment",
    "ReasoningGymTask",
    "VerifiersEnvironment",
    "check_environment",
    "default_reward",
    "environment_item_fields",
    "environment_preview",
    "environment_rows",
    "parse_environment",
]

#: The environment types a job may name, by their ``type``.
ENVIRONMENT_TYPES: dict[str, type[BaseModel]] = {
    "reasoning_gym": ReasoningGymEnvironment,
    "verifiers": VerifiersEnvironment,
}
#: Types of the same field that are designed but not built yet (named in the error a tenant gets).
PLANNED_TYPES = ("openenv",)


class EnvironmentSpecError(ValueError):
    """An invalid environment; ``field`` is the dotted path from the job (``environment.tasks[0].name``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


def _loc(parts: tuple[int | str, ...]) -> str:
    """Pydantic's location as our dotted path: ``("tasks", 0, "name")`` -> ``tasks[0].name``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def parse_environment(raw: Mapping[str, Any]) -> AnyEnvironment:
    """The spec's shape (types, bounds, unknown keys) checked, without its library: :class:`EnvironmentSpecError`
    naming the field."""
    if not isinstance(raw, Mapping):
        raise EnvironmentSpecError("environment", 'expected an object such as {"type": "reasoning_gym", ...}')
    kind = raw.get("type")
    model = ENVIRONMENT_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        planned = f"; planned: {', '.join(PLANNED_TYPES)}" if kind not in PLANNED_TYPES else ""
        state = " is planned but not available yet" if kind in PLANNED_TYPES else " is not a known type"
        raise EnvironmentSpecError(
            "environment.type", f"{kind!r}{state} (known: {', '.join(ENVIRONMENT_TYPES)}{planned})"
        )
    try:
        return cast(AnyEnvironment, model.model_validate(dict(raw)))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise EnvironmentSpecError(f"environment{_loc(tuple(err['loc']))}", err["msg"]) from None


def check_environment(raw: Mapping[str, Any]) -> AnyEnvironment:
    """:func:`parse_environment` plus what only the type's library can tell (task names, config fields, a first
    item that generates); :class:`EnvironmentSpecError` naming the field and listing the known values. A
    ``verifiers`` environment's library is the worker's alone (its id is checked against the operator's list by
    `gspo_core.environments.verifiers_env.check_allowed`)."""
    env = parse_environment(raw)
    if isinstance(env, VerifiersEnvironment):
        return env
    from gspo_core.environments import reasoning_gym

    reasoning_gym.check(env)
    return env


def environment_rows(env: AnyEnvironment) -> tuple[list[dict], list[dict]]:
    """``(training rows, held-out rows)``: the same item dicts a JSONL file's rows are (a ``verifiers``
    environment's come from its runner: `gspo_core.environments.verifiers_env.VerifiersRunner.rows`)."""
    from gspo_core.environments import reasoning_gym

    if isinstance(env, VerifiersEnvironment):
        raise EnvironmentSpecError("environment.type", "a verifiers environment's rows come from its runner")
    return reasoning_gym.rows(env)


def environment_preview(env: AnyEnvironment, n: int) -> list[dict]:
    """The first ``n`` training rows (the same as :func:`environment_rows`'s), without generating the rest; none
    for a ``verifiers`` environment (only the worker imports it: its rows are the rollouts' items)."""
    from gspo_core.environments import reasoning_gym

    if isinstance(env, VerifiersEnvironment):
        return []
    return reasoning_gym.first_rows(env, n)


def environment_item_fields(env: AnyEnvironment) -> set[str]:
    """The item fields every row of the environment has (what graders may name as ``{{item.x}}``)."""
    return set(VERIFIERS_ITEM_FIELDS if isinstance(env, VerifiersEnvironment) else ITEM_FIELDS)


def default_reward(env_type: str | None) -> dict[str, Any]:
    """The reward of a job that names an environment (by its ``type``) and no grader: the environment's own
    scoring (its ``answer`` score)."""
    if env_type == "verifiers":
        return {"type": "verifiers", "name": "rubric"}  # the episode's own reward (its tasks' @vf.reward sum)
    return {"type": "reasoning_gym", "name": "answer"} if env_type == "reasoning_gym" else {}

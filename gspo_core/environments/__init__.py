"""A job's environment: where its prompts and rewards come from when it names one instead of a dataset.

One field, ``environment``, with a ``type`` discriminator. ``reasoning_gym`` (procedural tasks by name) is
built; ``verifiers`` and ``openenv`` are planned as further types of the same field (docs/environments.md).
An environment of a dataset-like type yields the same item dicts a JSONL file would (:func:`environment_rows`),
so the rest of the loop is unchanged. Validating a spec imports no torch; a type's library is imported only
when the spec names that type. Given an :class:`~gspo_core.environments.isolated.Isolation` (the service does),
generation runs in a killable grader-pool process within a time budget, never in the caller's threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from gspo_core.environments.spec import (
    DEFAULT_SYSTEM_PROMPT,
    ITEM_FIELDS,
    ReasoningGymEnvironment,
    ReasoningGymTask,
)

if TYPE_CHECKING:
    from gspo_core.environments.isolated import Isolation

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ENVIRONMENT_TYPES",
    "PLANNED_TYPES",
    "EnvironmentSpecError",
    "ReasoningGymEnvironment",
    "ReasoningGymTask",
    "check_environment",
    "default_reward",
    "environment_item_fields",
    "environment_preview",
    "environment_rows",
    "parse_environment",
    "write_environment_rows",
]

#: The environment types a job may name, by their ``type``.
ENVIRONMENT_TYPES: dict[str, type[BaseModel]] = {"reasoning_gym": ReasoningGymEnvironment}
#: Types of the same field that are designed but not built yet (named in the error a tenant gets).
PLANNED_TYPES = ("verifiers", "openenv")


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


def parse_environment(raw: Mapping[str, Any]) -> ReasoningGymEnvironment:
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
        return ReasoningGymEnvironment.model_validate(dict(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise EnvironmentSpecError(f"environment{_loc(tuple(err['loc']))}", err["msg"]) from None


def check_environment(
    raw: Mapping[str, Any], isolation: Isolation | None = None, max_row_bytes: int | None = None
) -> ReasoningGymEnvironment:
    """:func:`parse_environment` plus what only the type's library can tell (task names, config fields, a first
    item that generates, within ``max_row_bytes``); :class:`EnvironmentSpecError` naming the field and listing the
    known values. With ``isolation``, the library runs in a grader-pool process within its time (past it: the
    error names the task's ``config``); without, in this thread (``gspo train``)."""
    env = parse_environment(raw)
    if isolation is not None:
        from gspo_core.environments.isolated import check_isolated

        check_isolated(env, isolation, max_row_bytes)
        return env
    from gspo_core.environments import reasoning_gym

    reasoning_gym.check(env, max_row_bytes)
    return env


def environment_rows(env: ReasoningGymEnvironment) -> tuple[list[dict], list[dict]]:
    """``(training rows, held-out rows)``: the same item dicts a JSONL file's rows are (generated in this thread)."""
    from gspo_core.environments import reasoning_gym

    return reasoning_gym.rows(env)


def write_environment_rows(
    env: ReasoningGymEnvironment,
    train_path: str,
    held_out_path: str,
    isolation: Isolation,
    max_bytes: int,
    max_row_bytes: int,
) -> tuple[int, int]:
    """:func:`environment_rows` written as two JSONL files by a grader-pool process within ``isolation``'s time
    and the byte caps; ``(training rows, held-out rows)`` written, or :class:`EnvironmentSpecError`."""
    from gspo_core.environments.isolated import write_isolated

    return write_isolated(env, train_path, held_out_path, isolation, max_bytes, max_row_bytes)


def environment_preview(env: ReasoningGymEnvironment, n: int, isolation: Isolation | None = None) -> list[dict]:
    """The first ``n`` training rows (the same as :func:`environment_rows`'s), without generating the rest (with
    ``isolation``: in a grader-pool process within its time)."""
    if isolation is not None:
        from gspo_core.environments.isolated import preview_isolated

        return preview_isolated(env, n, isolation)
    from gspo_core.environments import reasoning_gym

    return reasoning_gym.first_rows(env, n)


def environment_item_fields(env: ReasoningGymEnvironment) -> set[str]:
    """The item fields every row of the environment has (what graders may name as ``{{item.x}}``)."""
    return set(ITEM_FIELDS)


def default_reward(env_type: str | None) -> dict[str, Any]:
    """The reward of a job that names an environment (by its ``type``) and no grader: the environment's own
    scoring (its ``answer`` score)."""
    return {"type": "reasoning_gym", "name": "answer"} if env_type == "reasoning_gym" else {}

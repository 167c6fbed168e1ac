"""A job's environment: where its prompts and rewards come from when it names one instead of a dataset.

One field, ``environment``, with a ``type`` discriminator. ``reasoning_gym`` (procedural tasks by name) and
``openenv`` (a tenant's OpenEnv server, whose episodes run in it: `gspo_core.environments.openenv`) and
``verifiers`` (an operator-allowed environment package, run in its own venv) are built (docs/environments.md).
An environment of a dataset-like type yields the same item dicts a JSONL file would (:func:`environment_rows`),
so the rest of the loop is unchanged. Validating a spec imports no torch; a type's library is imported only
when the spec names that type. Given an :class:`~gspo_core.environments.isolated.Isolation` (the service does),
generation runs in a killable grader-pool process within a time budget, never in the caller's threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, ValidationError

from gspo_core.environments.openenv_spec import OpenEnvEnvironment
from gspo_core.environments.spec import (
    DEFAULT_SYSTEM_PROMPT,
    ITEM_FIELDS,
    ReasoningGymEnvironment,
    ReasoningGymTask,
)
from gspo_core.environments.verifiers_env import VERIFIERS_ITEM_FIELDS, VerifiersEnvironment

#: A job's environment, as its type's spec.
Environment = ReasoningGymEnvironment | OpenEnvEnvironment | VerifiersEnvironment

if TYPE_CHECKING:
    from gspo_core.environments.isolated import Isolation
    from gspo_core.rewards.policy import GraderPolicy

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ENVIRONMENT_TYPES",
    "PLANNED_TYPES",
    "Environment",
    "EnvironmentSpecError",
    "OpenEnvEnvironment",
    "ReasoningGymEnvironment",
    "ReasoningGymTask",
    "VerifiersEnvironment",
    "check_environment",
    "default_reward",
    "environment_item_fields",
    "environment_preview",
    "environment_rows",
    "episode_environment",
    "parse_environment",
    "write_environment_rows",
]

#: The environment types a job may name, by their ``type``.
ENVIRONMENT_TYPES: dict[str, type[BaseModel]] = {
    "reasoning_gym": ReasoningGymEnvironment,
    "openenv": OpenEnvEnvironment,
    "verifiers": VerifiersEnvironment,
}
#: Types of the same field that are designed but not built yet (named in the error a tenant gets).
PLANNED_TYPES: tuple[str, ...] = ()


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


def parse_environment(raw: Mapping[str, Any]) -> Environment:
    """The spec's shape (types, bounds, unknown keys) checked, without its library: :class:`EnvironmentSpecError`
    naming the field."""
    if not isinstance(raw, Mapping):
        raise EnvironmentSpecError("environment", 'expected an object such as {"type": "reasoning_gym", ...}')
    kind = raw.get("type")
    model = ENVIRONMENT_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        planned = f"; planned: {', '.join(PLANNED_TYPES)}" if PLANNED_TYPES and kind not in PLANNED_TYPES else ""
        state = " is planned but not available yet" if kind in PLANNED_TYPES else " is not a known type"
        raise EnvironmentSpecError(
            "environment.type", f"{kind!r}{state} (known: {', '.join(ENVIRONMENT_TYPES)}{planned})"
        )
    try:
        return cast(Environment, model.model_validate(dict(raw)))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise EnvironmentSpecError(f"environment{_loc(tuple(err['loc']))}", err["msg"]) from None


def check_environment(
    raw: Mapping[str, Any],
    isolation: Isolation | None = None,
    max_row_bytes: int | None = None,
    *,
    egress_allow: Iterable[str] | None = None,
) -> Environment:
    """:func:`parse_environment` plus what only the type's library can tell (task names, config fields, a first
    item that generates, within ``max_row_bytes``) or the egress policy (an OpenEnv server's URL and headers, under
    the operator's allow-list ``egress_allow``; None: not checked here, and checked where it is connected to);
    :class:`EnvironmentSpecError` naming the field and listing the known values. With ``isolation``, a generator
    runs in a grader-pool process within its time (past it: the error names the task's ``config``); without, in
    this thread (``gspo train``). A ``verifiers`` environment's library is the worker's alone (its id is checked
    against the operator's list by `gspo_core.environments.verifiers_env.check_allowed`)."""
    env = parse_environment(raw)
    if isinstance(env, VerifiersEnvironment):
        return env
    if isinstance(env, OpenEnvEnvironment):
        from gspo_core.environments import openenv

        if egress_allow is not None:
            openenv.check(env, tuple(egress_allow))
        return env
    if isolation is not None:
        from gspo_core.environments.isolated import check_isolated

        check_isolated(env, isolation, max_row_bytes)
        return env
    from gspo_core.environments import reasoning_gym

    reasoning_gym.check(env, max_row_bytes)
    return env


def environment_rows(env: Environment) -> tuple[list[dict], list[dict]]:
    """``(training rows, held-out rows)``: the same item dicts a JSONL file's rows are, generated in this thread
    (a ``verifiers`` environment's come from its runner: `verifiers_env.VerifiersRunner.rows`)."""
    if isinstance(env, OpenEnvEnvironment):
        from gspo_core.environments import openenv

        return openenv.rows(env)
    from gspo_core.environments import reasoning_gym

    if isinstance(env, VerifiersEnvironment):
        raise EnvironmentSpecError("environment.type", "a verifiers environment's rows come from its runner")
    return reasoning_gym.rows(env)


def write_environment_rows(
    env: ReasoningGymEnvironment,
    train_path: str,
    held_out_path: str,
    isolation: Isolation,
    max_bytes: int,
    max_row_bytes: int,
) -> tuple[int, int]:
    """:func:`environment_rows` of a generated (``reasoning_gym``) environment written as two JSONL files by a
    grader-pool process within ``isolation``'s time and the byte caps; ``(training rows, held-out rows)`` written,
    or :class:`EnvironmentSpecError`."""
    from gspo_core.environments.isolated import write_isolated

    return write_isolated(env, train_path, held_out_path, isolation, max_bytes, max_row_bytes)


def environment_preview(env: Environment, n: int, isolation: Isolation | None = None) -> list[dict]:
    """The first ``n`` training rows (the same as :func:`environment_rows`'s), without generating the rest (with
    ``isolation``: in a grader-pool process within its time); none for a ``verifiers`` environment (only the
    worker imports it: its rows are the rollouts' items)."""
    if isinstance(env, OpenEnvEnvironment):
        from gspo_core.environments import openenv

        return openenv.first_rows(env, n)
    if isinstance(env, VerifiersEnvironment):
        return []
    if isolation is not None:
        from gspo_core.environments.isolated import preview_isolated

        return preview_isolated(env, n, isolation)
    from gspo_core.environments import reasoning_gym

    return reasoning_gym.first_rows(env, n)


def environment_item_fields(env: Environment) -> set[str]:
    """The item fields every row of the environment has (what graders may name as ``{{item.x}}``)."""
    if isinstance(env, OpenEnvEnvironment):
        from gspo_core.environments.openenv import ITEM_FIELDS as OPENENV_FIELDS

        return set(OPENENV_FIELDS)
    return set(VERIFIERS_ITEM_FIELDS if isinstance(env, VerifiersEnvironment) else ITEM_FIELDS)


def default_reward(env_type: str | None) -> dict[str, Any]:
    """The reward of a job that names an environment (by its ``type``) and no grader: the environment's own
    scoring (its ``answer`` score)."""
    if env_type == "openenv":
        return {"type": "openenv"}  # the episode's reward is the server's (`gspo_core.rewards.openenv_grader`)
    if env_type == "verifiers":
        return {"type": "verifiers", "name": "rubric"}  # the episode's own reward (its tasks' @vf.reward sum)
    return {"type": "reasoning_gym", "name": "answer"} if env_type == "reasoning_gym" else {}


def episode_environment(
    raw: Mapping[str, Any] | None, policy: GraderPolicy, max_prompt_tokens: int, tools: list | None = None
):
    """The factory of the rollouts' environment for an environment whose episodes run in it (``openenv``), with
    its ``max_turns``; None for a dataset-like one. Its URL is checked again under the worker's policy; it
    comes without ``tools`` (the server is what answers the model)."""
    if raw is None or raw.get("type") != "openenv":
        return None
    if tools:
        raise EnvironmentSpecError("tools", "an openenv environment answers the model itself: give no tools")
    from gspo_core.environments.openenv import OpenEnvFactory

    env = check_environment(raw, egress_allow=policy.egress_allow)
    assert isinstance(env, OpenEnvEnvironment)
    return OpenEnvFactory(env, policy, max_prompt_tokens)

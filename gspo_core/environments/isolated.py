"""An environment's generator run in a grader-pool process: killed past its time, capped in memory, niced.

A task's generator is third-party code shaped by the tenant's config (a chain of 4000 terms, an expression
whose evaluation never ends): run in the service's own threads it would hold the GIL and stall them. The
API's check and preview and the worker's generation send it to the grader pool instead
(``gspo_core.rewards.pool``, whose processes already stop, cap and replace graders), as one call per task
checked or per generation, within the operator's time. The ``warm``/``check_task``/``preview``/``write``
functions below are what those processes run (``pool_child.CALLS``), with JSON arguments.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from gspo_core.environments import reasoning_gym
from gspo_core.environments.spec import ReasoningGymEnvironment
from gspo_core.rewards.policy import GraderPolicy
from gspo_core.rewards.pool import CallError, pool_for


@dataclass(frozen=True)
class Isolation:
    """Where an environment's generator runs and for how long: a process of ``policy``'s grader pool (its memory
    cap, ``pool_memory_mb``, and niceness) for at most ``timeout_s`` seconds per check, preview or generation;
    ``setting`` names the operator's knob for that time in the errors."""

    policy: GraderPolicy
    timeout_s: float
    setting: str = ""


class EnvironmentBusy(RuntimeError):
    """No grader-pool process was free (or could start) within the time: the service's state, not the spec's."""


def _spec_error(exc: CallError, where: str, what: str, isolation: Isolation) -> Exception:
    """A pool call's failure as the spec error (naming ``where`` unless the generator named a field itself)."""
    from gspo_core.environments import EnvironmentSpecError

    knob = f" (the operator's {isolation.setting})" if isolation.setting else ""
    if exc.kind == "busy" or (exc.kind == "killed" and "could not start" in exc.message):
        return EnvironmentBusy(f"no grader process was free to generate {what}: {exc.message}")
    if exc.kind == "timeout":
        message = f"generating {what} took longer than {isolation.timeout_s:g} s{knob}; ask for smaller values"
    elif exc.kind == "memory":
        message = f"generating {what} ran out of memory ({isolation.policy.pool_memory_mb} MB); ask for smaller values"
    elif exc.kind == "killed":
        message = f"while generating {what}, {exc.message}; ask for smaller values"
    else:
        message = exc.message
    return EnvironmentSpecError(exc.field or where, message)


def check_isolated(env: ReasoningGymEnvironment, isolation: Isolation, max_row_bytes: int | None) -> None:
    """``reasoning_gym.check`` in the pool, one call per task (a task that overruns is the one named), all of
    them within ``isolation.timeout_s``."""
    pool = pool_for(isolation.policy)
    deadline = time.monotonic() + isolation.timeout_s
    for i in range(len(env.tasks)):
        left = max(0.01, deadline - time.monotonic())
        try:
            pool.call(
                "environment.check_task", {"env": env.model_dump(), "index": i, "max_row_bytes": max_row_bytes}, left
            )
        except CallError as exc:
            where, what = f"environment.tasks[{i}].config", f"{env.tasks[i].name}'s first item"
            raise _spec_error(exc, where, what, isolation) from None


def preview_isolated(env: ReasoningGymEnvironment, n: int, isolation: Isolation) -> list[dict]:
    """The first ``n`` training items, generated in the pool within ``isolation.timeout_s``."""
    try:
        return pool_for(isolation.policy).call(
            "environment.preview", {"env": env.model_dump(), "n": n}, isolation.timeout_s
        )
    except CallError as exc:
        raise _spec_error(exc, "environment", f"{n} item{'s' if n != 1 else ''}", isolation) from None


def write_isolated(
    env: ReasoningGymEnvironment,
    train_path: str,
    held_out_path: str,
    isolation: Isolation,
    max_bytes: int,
    max_row_bytes: int,
) -> tuple[int, int]:
    """The environment's items written as JSONL files (training, held-out) in the pool within
    ``isolation.timeout_s``, at most ``max_bytes`` in all and ``max_row_bytes`` an item: ``(training items,
    held-out items)`` written."""
    args = {
        "env": env.model_dump(),
        "train_path": train_path,
        "held_out_path": held_out_path,
        "max_bytes": max_bytes,
        "max_row_bytes": max_row_bytes,
    }
    try:
        train, held_out = pool_for(isolation.policy).call("environment.write", args, isolation.timeout_s)
    except CallError as exc:
        raise _spec_error(exc, "environment", "the items", isolation) from None
    return int(train), int(held_out)


# What the pool processes run (pool_child.CALLS).


def warm() -> None:
    reasoning_gym.warm()


def check_task(env: dict[str, Any], index: int, max_row_bytes: int | None) -> None:
    reasoning_gym.check_task(ReasoningGymEnvironment.model_validate(env), index, max_row_bytes)


def preview(env: dict[str, Any], n: int) -> list[dict]:
    return reasoning_gym.first_rows(ReasoningGymEnvironment.model_validate(env), n)


def write(env: dict[str, Any], train_path: str, held_out_path: str, max_bytes: int, max_row_bytes: int) -> list[int]:
    """Items streamed to the two files (none held in memory), refused past the byte caps."""
    from gspo_core.environments import EnvironmentSpecError

    spec = ReasoningGymEnvironment.model_validate(env)
    task_index = {task.name: i for i, task in enumerate(spec.tasks)}
    counts, total = [0, 0], 0
    with open(train_path, "w") as train, open(held_out_path, "w") as held_out:
        for is_held_out, row in reasoning_gym.iter_rows(spec):
            line = json.dumps(row) + "\n"
            size = len(line.encode())
            if size > max_row_bytes:
                raise EnvironmentSpecError(
                    f"environment.tasks[{task_index[row['task']]}].config",
                    f"an item of {row['task']} is {size} bytes, more than a dataset row may be ({max_row_bytes})",
                )
            total += size
            if total > max_bytes:
                raise EnvironmentSpecError(
                    "environment.size", f"the items take more than {max_bytes} bytes; ask for fewer or smaller ones"
                )
            (held_out if is_held_out else train).write(line)
            counts[is_held_out] += 1
    return counts

"""reasoning-gym tasks as a job's items: checked names and configs, deterministic generation, a disjoint
held-out split, and each task's own ``score_answer`` (PyPI ``reasoning-gym``, imported only here, lazily)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gspo_core.environments.spec import ReasoningGymEnvironment

if TYPE_CHECKING:
    from types import ModuleType

#: The held-out split's generator seed is the training seed plus this: both seed their items' RNGs with
#: ``seed + index`` (reasoning-gym's composite dataset), so for any training size the two draw from disjoint
#: RNG streams; items that still coincide (a small task's question space) are dropped by question.
HELD_OUT_SEED_OFFSET = 1_000_000_007
#: Held-out indices tried per held-out item wanted, before the split is left smaller than asked.
HELD_OUT_TRIES = 4
#: Config fields the environment sets itself, not the task's config.
OWN_FIELDS = ("seed", "size")
_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
#: A number as a weak model writes it in prose: sign, thousands separators, decimals ("-1,234.5").
_NUMBER = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?")


def _library() -> ModuleType:
    from gspo_core.environments import EnvironmentSpecError

    try:
        import reasoning_gym
    except ImportError:
        raise EnvironmentSpecError(
            "environment.type", "reasoning_gym: the reasoning-gym package is not installed on this server"
        ) from None
    return reasoning_gym


def known_tasks() -> list[str]:
    """The task names reasoning-gym registers (its composite dataset aside: tasks are combined here)."""
    from reasoning_gym.factory import DATASETS

    _library()
    return sorted(name for name in DATASETS if name != "composite")


def config_fields(task: str) -> list[str]:
    """The fields of a task's config dataclass that a job may set."""
    from reasoning_gym.factory import DATASETS

    return [f.name for f in dataclasses.fields(DATASETS[task][1]) if f.name not in OWN_FIELDS]


def warm() -> None:
    """The library's imports (seconds on a loaded machine), before a generator's time starts."""
    _library()  # a spec error when the package is missing
    import reasoning_gym.composite  # noqa: F401


def check(env: ReasoningGymEnvironment, max_row_bytes: int | None = None) -> None:
    """Every task is known, named once, and configured with its own fields; each generates a first item (no larger
    than ``max_row_bytes`` as a JSON line). :class:`~gspo_core.environments.EnvironmentSpecError` naming the field
    and listing the known values."""
    for i in range(len(env.tasks)):
        check_task(env, i, max_row_bytes)


def check_task(env: ReasoningGymEnvironment, i: int, max_row_bytes: int | None = None) -> None:
    """:func:`check` of the ``i``-th task (a generator that never ends is the caller's to stop)."""
    from gspo_core.environments import EnvironmentSpecError

    lib, names, task = _library(), known_tasks(), env.tasks[i]
    where = f"environment.tasks[{i}]"
    if task.name not in names:
        raise EnvironmentSpecError(
            f"{where}.name", f"unknown reasoning-gym task {task.name!r} (known: {', '.join(names)})"
        )
    if task.name in {other.name for other in env.tasks[:i]}:
        raise EnvironmentSpecError(f"{where}.name", f"task {task.name!r} is named twice")
    fields = config_fields(task.name)
    for key in task.config:
        if key in OWN_FIELDS:
            raise EnvironmentSpecError(
                f"{where}.config.{key}", f"set by the environment's own `{key}`, not a task's config"
            )
        if key not in fields:
            raise EnvironmentSpecError(
                f"{where}.config.{key}",
                f"not a config field of {task.name} (known: {', '.join(fields) or 'none'})",
            )
    try:
        entry = lib.create_dataset(task.name, seed=env.seed, size=1, **task.config)[0]
    except MemoryError:  # the process's cap, not the config's values: its caller says so
        raise
    except Exception as exc:  # the task's own validate() (assertions) or its generator refusing the values
        raise EnvironmentSpecError(
            f"{where}.config", f"{task.name} refused this config: {type(exc).__name__}: {exc}"[:1000]
        ) from None
    if max_row_bytes is not None:
        size = len(json.dumps(entry, default=_jsonable).encode())
        if size > max_row_bytes:
            raise EnvironmentSpecError(
                f"{where}.config", f"its first item is {size} bytes, more than a dataset row may be ({max_row_bytes})"
            )


def _jsonable(value: Any) -> Any:
    """What JSON keeps of a value a task put in its metadata (a set becomes a sorted list, others text)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return str(value)


def _item(entry: dict, configs: dict[str, dict], system_prompt: str | None) -> dict:
    """A generated entry as the item dict a JSONL row would be: the question as a chat message, and what
    the task's scorer needs (JSON-only values, as a stored row has)."""
    entry = json.loads(json.dumps(entry, default=_jsonable))
    task = entry["metadata"]["source_dataset"]
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": entry["question"]})
    return {
        "messages": messages,
        "question": entry["question"],
        "answer": entry["answer"],
        "metadata": entry["metadata"],
        "task": task,
        "task_config": configs[task],
    }


def _composite(env: ReasoningGymEnvironment, seed: int, size: int):
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(task.name, task.weight, dict(task.config)) for task in env.tasks]
    return _library().create_dataset("composite", seed=seed, size=size, datasets=specs)


def first_rows(env: ReasoningGymEnvironment, n: int) -> list[dict]:
    """The first ``n`` training items (the same as :func:`rows`'s: an item is a function of its index)."""
    configs = {task.name: dict(task.config) for task in env.tasks}
    train_set = _composite(env, env.seed, env.size)
    return [_item(train_set[i], configs, env.system_prompt) for i in range(min(n, env.size))]


def iter_rows(env: ReasoningGymEnvironment) -> Iterator[tuple[bool, dict]]:
    """``(held_out, item)``: ``env.size`` training items of the tasks (drawn by weight) from ``env.seed``, then up
    to ``env.validation_size`` held-out items from the held-out seed whose questions no training item has (one at
    a time: the caller may write them out as they come)."""
    configs = {task.name: dict(task.config) for task in env.tasks}
    train_set = _composite(env, env.seed, env.size)
    questions: set[str] = set()
    for i in range(env.size):
        row = _item(train_set[i], configs, env.system_prompt)
        questions.add(row["question"])
        yield False, row
    if not env.validation_size:
        return
    tries, kept = env.validation_size * HELD_OUT_TRIES, 0
    held_out_set = _composite(env, env.seed + HELD_OUT_SEED_OFFSET, tries)
    for i in range(tries):
        row = _item(held_out_set[i], configs, env.system_prompt)
        if row["question"] not in questions:
            questions.add(row["question"])  # and no question twice within the split
            yield True, row
            kept += 1
            if kept == env.validation_size:
                return


def rows(env: ReasoningGymEnvironment) -> tuple[list[dict], list[dict]]:
    """``(training items, held-out items)`` of :func:`iter_rows`."""
    train: list[dict] = []
    held_out: list[dict] = []
    for is_held_out, row in iter_rows(env):
        (held_out if is_held_out else train).append(row)
    return train, held_out


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The answer in a completion: ``answer_tag`` the last ``<answer>...</answer>`` (None without one, as
    reasoning-gym's own ``extract_answer``); ``auto`` that, else the last non-empty line; ``number`` the tags,
    else the last number in the text ("17 + 25 = 42." -> "42"); ``none`` the text."""
    if mode == "none":
        return text.strip()
    tagged = _ANSWER.findall(text)
    if tagged:
        return tagged[-1].strip()
    if mode == "answer_tag":
        return None
    if mode == "number":
        numbers = _NUMBER.findall(text)
        return numbers[-1].replace(",", "") if numbers else None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_json: str):
    """A task's dataset built with a config (its scorer may read the config); one per (task, config)."""
    return _library().create_dataset(task, size=1, seed=0, **json.loads(config_json))


def score(answer: str | None, item: dict) -> float:
    """The item's task's own ``score_answer`` of ``answer`` (the item: a generated one, or any with ``task``
    and ``answer``, ``metadata`` and ``task_config`` optional)."""
    task = item.get("task")
    if not isinstance(task, str) or task not in known_tasks():
        raise ValueError(f"item.task: {task!r} is not a reasoning-gym task")
    config = item.get("task_config") or {}
    dataset = _dataset(task, json.dumps(config, sort_keys=True))
    entry = {"question": item.get("question", ""), "answer": item["answer"], "metadata": item.get("metadata") or {}}
    return float(dataset.score_answer(answer, entry))

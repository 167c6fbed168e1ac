"""OpenAI's reinforcement hyperparameters mapped onto GSPOConfig's fields, and back (docs/openai.md has the table).

Each OpenAI key is ``"auto"`` or a value; ``"auto"`` resolves to the value the job runs with, which the job
shows back. GSPOConfig's own fields are accepted in the same dict as extensions; one given both ways must agree.
"""

from __future__ import annotations

import math
from typing import Any

from api.errors import ApiError
from gspo_core.config import GSPOConfig

PARAM = "method.reinforcement.hyperparameters"
BASE_LR = float(GSPOConfig.model_fields["learning_rate"].default)
BASE_GROUP = int(GSPOConfig.model_fields["group_size"].default)
#: OpenAI key -> the GSPOConfig field it sets.
NATIVE = {
    "batch_size": "prompts_per_step",
    "n_epochs": "steps",
    "learning_rate_multiplier": "learning_rate",
    "eval_interval": "eval_every",
    "eval_samples": "eval_prompts",
    "compute_multiplier": "group_size",
}
OPENAI_KEYS = {*NATIVE, "reasoning_effort"}


def _number(hp: dict[str, Any], key: str, kind: type) -> float | None:
    """The key's value, None for "auto" (or absent); 400 naming it when neither."""
    value = hp.get(key, "auto")
    if value is None or value == "auto":
        return None
    ok = (
        isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer())
    )
    if not ok or value <= 0:
        what = "a positive integer" if kind is int else "a positive number"
        raise ApiError(422, "invalid_hyperparameters", f"{PARAM}.{key}: 'auto' or {what}", f"{PARAM}.{key}")
    return float(value)


def _set(native: dict[str, Any], key: str, value: Any) -> None:
    """Set the GSPOConfig field ``NATIVE[key]``; a native value given too must be the same."""
    field = NATIVE[key]
    if field in native and native[field] != value:
        raise ApiError(
            422,
            "invalid_hyperparameters",
            f"{PARAM}.{key} sets {field} to {value}, but {field} is also given as {native[field]}; give one",
            f"{PARAM}.{key}",
        )
    native[field] = value


def to_native(hp: dict[str, Any], rows: int, has_validation: bool) -> dict[str, Any]:
    """GSPOConfig's fields for OpenAI's ``hyperparameters`` (plus native extensions) over a ``rows``-row file."""
    native = {k: v for k, v in hp.items() if k not in OPENAI_KEYS}
    effort = hp.get("reasoning_effort")
    if effort not in (None, "auto", "default"):
        raise ApiError(
            422,
            "invalid_hyperparameters",
            f"{PARAM}.reasoning_effort: open-weight models here have no reasoning-effort control; use 'default'",
            f"{PARAM}.reasoning_effort",
        )
    defaults = GSPOConfig.model_fields
    batch = _number(hp, "batch_size", int)
    if batch is not None:
        _set(native, "batch_size", int(batch))
    if (multiplier := _number(hp, "compute_multiplier", float)) is not None:
        _set(native, "compute_multiplier", max(2, round(BASE_GROUP * multiplier)))
    if (lr_mult := _number(hp, "learning_rate_multiplier", float)) is not None:
        _set(native, "learning_rate_multiplier", BASE_LR * lr_mult)
    prompts = native.get("prompts_per_step", defaults["prompts_per_step"].default)
    epochs = _number(hp, "n_epochs", int)
    if epochs is not None or "steps" not in native:  # auto: one pass over the training file
        per_step = prompts if isinstance(prompts, int) and not isinstance(prompts, bool) and prompts > 0 else 1
        _set(native, "n_epochs", max(1, math.ceil((epochs or 1) * rows / per_step)))
    if (interval := _number(hp, "eval_interval", int)) is not None:
        _set(native, "eval_interval", int(interval))
    elif has_validation and "eval_every" not in native:  # auto: ten evaluations over the run
        steps = native["steps"] if isinstance(native.get("steps"), int) else 1
        native["eval_every"] = max(1, steps // 10)
    if (samples := _number(hp, "eval_samples", int)) is not None:
        _set(native, "eval_samples", int(samples))
    return native


def field_param(field: str | None, hp: dict[str, Any]) -> str | None:
    """Our error's field as the OpenAI request ``hp`` named it (``hyperparameters.prompts_per_step`` ->
    ``method.reinforcement.hyperparameters.batch_size`` when batch_size set it; ``reward.x`` -> ``...grader.x``)."""
    if field is None:
        return None
    head, _, rest = field.partition(".")
    if head == "hyperparameters":
        given = [key for key, native in NATIVE.items() if native == rest and hp.get(key) not in (None, "auto")]
        return f"{PARAM}.{given[0] if given else rest}" if rest else PARAM
    if head == "reward":
        return "method.reinforcement.grader" + (f".{rest}" if rest else "")
    return field


def from_native(cfg: dict[str, Any], rows: int | None) -> dict[str, Any]:
    """OpenAI's hyperparameters as the job runs them (``n_epochs``: passes over the training file, null
    once the file is deleted)."""
    prompts, steps = int(cfg.get("prompts_per_step", 8)), int(cfg.get("steps", 1))
    epochs = round(steps * prompts / rows, 3) if rows else None
    return {
        "batch_size": prompts,
        "n_epochs": int(epochs) if epochs is not None and epochs.is_integer() else epochs,
        "learning_rate_multiplier": round(float(cfg.get("learning_rate", BASE_LR)) / BASE_LR, 6),
        "eval_interval": int(cfg.get("eval_every", 0)),
        "eval_samples": int(cfg.get("eval_prompts", 32)),
        "compute_multiplier": round(int(cfg.get("group_size", BASE_GROUP)) / BASE_GROUP, 6),
        "reasoning_effort": "default",
    }

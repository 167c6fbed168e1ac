"""OpenAI's reinforcement and supervised hyperparameters mapped onto GSPOConfig's fields, and back (docs/openai.md).

Each OpenAI key is ``"auto"`` or a value; ``"auto"`` resolves to the value the job runs with, which the job
shows back. GSPOConfig's own fields are accepted in the same dict as extensions; one given both ways must agree.
"""

from __future__ import annotations

import math
from typing import Any

from api.errors import ApiError
from api.openai_schemas import MAX_HYPERPARAMETER, SUPERVISED_HYPERPARAMETERS
from gspo_core.config import GSPOConfig

PARAM = "method.reinforcement.hyperparameters"
#: Passes over the training file of a supervised job whose n_epochs is "auto" (a small file's usual number).
SUPERVISED_EPOCHS = 3
#: OpenAI's supervised keys (its other keys are reinforcement's; given here they are unknown GSPOConfig fields).
SUPERVISED_KEYS = SUPERVISED_HYPERPARAMETERS
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
    "max_episode_steps": "max_turns",  # Agent RFT: model turns of an episode with tools
}
OPENAI_KEYS = {*NATIVE, "reasoning_effort"}


def param_of(method: str) -> str:
    return f"method.{method}.hyperparameters"


def _number(hp: dict[str, Any], key: str, kind: type, param: str = PARAM) -> float | None:
    """The key's value, None for "auto" (or absent); 400 naming it when neither, or past :data:`MAX_HYPERPARAMETER`
    (checked before any conversion or arithmetic: float() of a 400-digit integer, or ceil() of 1e308 epochs
    times the rows, raises)."""
    value = hp.get(key, "auto")
    if value is None or value == "auto":
        return None
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_number and 0 < value <= MAX_HYPERPARAMETER and (kind is float or float(value).is_integer())
    if not ok:
        what = "a positive integer" if kind is int else "a positive number"
        raise ApiError(
            422,
            "invalid_hyperparameters",
            f"{param}.{key}: 'auto' or {what} of at most {MAX_HYPERPARAMETER}",
            f"{param}.{key}",
        )
    return float(value)


def _set(native: dict[str, Any], key: str, value: Any, param: str = PARAM) -> None:
    """Set the GSPOConfig field ``NATIVE[key]``; a native value given too must be the same."""
    field = NATIVE[key]
    if field in native and native[field] != value:
        raise ApiError(
            422,
            "invalid_hyperparameters",
            f"{param}.{key} sets {field} to {value}, but {field} is also given as {native[field]}; give one",
            f"{param}.{key}",
        )
    native[field] = value


def to_native(hp: dict[str, Any], rows: int, has_validation: bool, method: str = "reinforcement") -> dict[str, Any]:
    """GSPOConfig's fields for OpenAI's ``hyperparameters`` of ``method`` (plus native extensions) over a
    ``rows``-row file."""
    param = param_of(method)
    keys = OPENAI_KEYS if method == "reinforcement" else set(SUPERVISED_KEYS)
    native = {k: v for k, v in hp.items() if k not in keys}
    if method == "supervised":
        if native.setdefault("method", "supervised") != "supervised":
            raise ApiError(422, "invalid_hyperparameters", f"{param}.method: must be 'supervised'", f"{param}.method")
    elif hp.get("reasoning_effort") not in (None, "auto", "default"):
        raise ApiError(
            422,
            "invalid_hyperparameters",
            f"{param}.reasoning_effort: open-weight models here have no reasoning-effort control; use 'default'",
            f"{param}.reasoning_effort",
        )
    defaults = GSPOConfig.model_fields
    if (batch := _number(hp, "batch_size", int, param)) is not None:
        _set(native, "batch_size", int(batch), param)
    if method == "reinforcement" and (multiplier := _number(hp, "compute_multiplier", float, param)) is not None:
        _set(native, "compute_multiplier", max(2, round(BASE_GROUP * multiplier)), param)
    if (lr_mult := _number(hp, "learning_rate_multiplier", float, param)) is not None:
        _set(native, "learning_rate_multiplier", BASE_LR * lr_mult, param)
    prompts = native.get("prompts_per_step", defaults["prompts_per_step"].default)
    epochs = _number(hp, "n_epochs", int, param)
    if epochs is not None or "steps" not in native:  # auto: one pass (supervised: SUPERVISED_EPOCHS) over the file
        per_step = prompts if isinstance(prompts, int) and not isinstance(prompts, bool) and prompts > 0 else 1
        auto = 1 if method == "reinforcement" else SUPERVISED_EPOCHS
        _set(native, "n_epochs", max(1, math.ceil((epochs or auto) * rows / per_step)), param)
    if method == "reinforcement" and (interval := _number(hp, "eval_interval", int, param)) is not None:
        _set(native, "eval_interval", int(interval), param)
    elif has_validation and "eval_every" not in native:  # auto: ten evaluations over the run
        steps = native["steps"] if isinstance(native.get("steps"), int) else 1
        native["eval_every"] = max(1, steps // 10)
    if method == "reinforcement" and (samples := _number(hp, "eval_samples", int, param)) is not None:
        _set(native, "eval_samples", int(samples), param)
    if method == "reinforcement" and (turns := _number(hp, "max_episode_steps", int, param)) is not None:
        _set(native, "max_episode_steps", int(turns), param)
    return native


def field_param(field: str | None, hp: dict[str, Any], method: str = "reinforcement") -> str | None:
    """Our error's field as the OpenAI request ``hp`` named it (``hyperparameters.prompts_per_step`` ->
    ``method.reinforcement.hyperparameters.batch_size`` when batch_size set it; ``reward.x`` -> ``...grader.x``)."""
    if field is None:
        return None
    head, _, rest = field.partition(".")
    if head == "hyperparameters" and rest.startswith("response_format"):
        return f"method.reinforcement.{rest}"  # given beside the hyperparameters, as OpenAI has it
    if head == "hyperparameters":
        given = [key for key, native in NATIVE.items() if native == rest and hp.get(key) not in (None, "auto")]
        param = param_of(method)
        return f"{param}.{given[0] if given else rest}" if rest else param
    if head == "reward":
        return "method.reinforcement.grader" + (f".{rest}" if rest else "")
    if field.startswith("tools"):
        return f"method.reinforcement.{field}"
    return field


def from_native(cfg: dict[str, Any], rows: int | None) -> dict[str, Any]:
    """OpenAI's hyperparameters as the job runs them (``n_epochs``: passes begun over the training file, null
    once the file is deleted); a supervised job's are OpenAI's supervised keys only."""
    prompts, steps = int(cfg.get("prompts_per_step", 8)), int(cfg.get("steps", 1))
    # Passes begun over the file: OpenAI types n_epochs as an integer, and the job's `steps` (shown in
    # gspo_hyperparameters) may end part-way through a pass.
    epochs = math.ceil(round(steps * prompts / rows, 6)) if rows else None
    out = {
        "batch_size": prompts,
        "n_epochs": epochs,
        "learning_rate_multiplier": round(float(cfg.get("learning_rate", BASE_LR)) / BASE_LR, 6),
        "eval_interval": int(cfg.get("eval_every", 0)),
        "eval_samples": int(cfg.get("eval_prompts", 32)),
        "compute_multiplier": round(int(cfg.get("group_size", BASE_GROUP)) / BASE_GROUP, 6),
        "reasoning_effort": "default",
    }
    if int(cfg.get("max_turns", 1)) > 1:
        out["max_episode_steps"] = int(cfg["max_turns"])
    return {k: out[k] for k in SUPERVISED_KEYS} if cfg.get("method") == "supervised" else out

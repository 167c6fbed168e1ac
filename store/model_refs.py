"""Which models a job may name (a directory under the models directory, a hub id when allowed), and
the path the worker loads: one policy for the policy model and for every ``reward_model`` grader."""

from __future__ import annotations

import os
import re
from pathlib import Path

from store.settings import Settings

HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


class ModelRefError(ValueError):
    """A model reference the service refuses; the message says what is allowed."""


def check_local_or_hub(settings: Settings, model: str) -> None:
    """Raise :class:`ModelRefError` unless ``model`` is a model directory under ``models_dir`` (by
    name, or by a path that stays inside it) or an ``org/name`` hub id while hub models are allowed."""
    root = settings.models_dir.resolve()
    if model.startswith(("/", ".", "~")) or "\\" in model or ".." in model.split("/"):
        path = (root / model).resolve() if not model.startswith("/") else Path(model).resolve()
        if root not in path.parents and path != root:
            raise ModelRefError(f"model path must be inside the models directory {root}")
        if not (path / "config.json").is_file():
            raise ModelRefError(f"no model (config.json) at {model}")
        return
    entry = settings.models_dir / model
    local = entry.resolve()
    if os.path.lexists(entry) and root not in local.parents:  # e.g. a symlink pointing out of models_dir
        raise ModelRefError(f"model {model!r} resolves outside the models directory")
    if root in local.parents and (local / "config.json").is_file():
        return
    if HF_ID.match(model) and settings.allow_hub_models:
        return
    raise ModelRefError(f"unknown model {model!r}: use an org/name hub id or a directory under the models directory")


def resolve_model(models_dir: Path, model: str) -> str:
    """A name under the models directory becomes its path; hub ids and ckpt: refs pass through."""
    if model.startswith("ckpt:"):
        return model
    local = (models_dir / model).resolve()
    if models_dir.resolve() in local.parents and (local / "config.json").is_file():
        return str(local)
    return model

"""Checkpoints: a Hugging Face model directory plus the trainer state needed for exact resume.

Layout: ``<output_dir>/checkpoints/step-000010/{model/, adapter/ (LoRA), trainer_state.pt}``.
A checkpoint directory is written under a temporary name and renamed when complete, so a crash
mid-save never leaves a half checkpoint that resume would pick. The trainer gathers the model's and the
optimizer's full state dicts from its ranks (by parameter name); rank 0 writes them, and every rank of a
resumed run loads them into its shards, whatever the number of ranks that saved them.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gspo_core.distributed import load_full_state
from gspo_core.policy import Policy, save_hf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step-{step:06d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _is_lora(model: Policy) -> bool:
    return hasattr(model, "merge_and_unload")


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: Policy,
    tokenizer: PreTrainedTokenizerBase,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write model + trainer state for ``step`` atomically; returns the step directory. ``model_state`` and
    ``optimizer_state``: the full state dicts (`gspo_core.distributed.gather_state_dict`, ``gather_optimizer_state``).

    Full fine-tuning resumes its weights from ``model/`` itself (fp32 safetensors, no second copy);
    with LoRA ``model/`` is merged, so the (small) adapter tensors go into the trainer state.
    """
    final = step_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tokenizer, tmp / "model", model_state)
    state = {
        "step": step,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        **(extra or {}),
    }
    if _is_lora(model):
        state["trainable"] = {n: model_state[n] for n, p in model.named_parameters() if p.requires_grad}
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_trainer_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The trainer state saved next to a checkpoint's model (optimizer, scheduler, RNG, step)."""
    path = Path(ckpt_dir) / "trainer_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"resume_from: {ckpt_dir} has no trainer_state.pt (not a step-* checkpoint)")
    return torch.load(path, map_location="cpu", weights_only=False)


def _saved_weights(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((Path(ckpt_dir) / "model").glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"resume_from: {ckpt_dir}/model holds no safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def by_name(optimizer_state: dict[str, Any], trainable: list[str]) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, as the trainer saves it; one saved by an earlier version
    (``optimizer.state_dict()``: parameters by position among the ``trainable`` ones) is converted."""
    groups = optimizer_state["param_groups"]
    if all(isinstance(param, str) for group in groups for param in group["params"]):
        return optimizer_state
    return {
        "state": {trainable[index]: value for index, value in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": [trainable[i] for i in group["params"]]} for group in groups],
    }


def restore(
    model: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    ckpt_dir: str | Path,
) -> int:
    """Load trainable weights, optimizer, scheduler and RNG from a checkpoint into this rank's shards;
    returns its step."""
    weights = state.get("trainable") or _saved_weights(ckpt_dir)
    params = dict(model.named_parameters())  # tied weights appear once, as save_pretrained keeps them
    wanted = [n for n, p in params.items() if p.requires_grad]
    missing = [n for n in wanted if n not in weights]
    if missing:
        raise ValueError(
            f"resume_from: checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[0]!r} "
            "(was it saved from another model or LoRA setting?)"
        )
    load_full_state(model, optimizer, {name: weights[name] for name in wanted}, by_name(state["optimizer"], wanted))
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])


def latest_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``step-*`` directory under ``output_dir/checkpoints``, if any."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    steps = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := STEP_DIR.match(path.name)) and (path / "trainer_state.pt").exists()
    ]
    return str(max(steps)[1]) if steps else None

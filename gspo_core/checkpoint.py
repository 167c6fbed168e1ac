"""Checkpoints: the trainer's sharded state (exact resume at any number of ranks) beside a Hugging Face export.

Layout: ``<output_dir>/checkpoints/step-000010/{trainer/ (DCP: each rank's shards of the trainable weights
and their optimizer state, plus .metadata), model/ (HF: safetensors + config + tokenizer, merged for LoRA),
adapter/ (LoRA), trainer_state.pt (step, scheduler, every rank's RNG, data cursor)}``. A checkpoint directory
is written under a temporary name and renamed when complete, so a crash mid-save never leaves a half
checkpoint that resume would pick. ``model/`` and ``adapter/`` are for downloads and serving; resume reads
``trainer/`` (a checkpoint written before it existed resumes from the full state dicts it holds instead).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gspo_core.distributed import (
    LeadWriter,
    Ranks,
    barrier,
    gather,
    gather_state_dict,
    load_full_state,
    load_sharded,
    save_sharded,
)
from gspo_core.policy import Policy

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


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: Policy,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    ranks: Ranks,
    writer: LeadWriter,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically (a collective: every rank calls it, on one machine's
    ``output_dir``; ``writer``, rank 0's, writes the export and the trainer state); returns the step directory
    once it is complete."""
    final = step_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    writer.remove(tmp)
    barrier(ranks)  # no rank writes its shards into the directory rank 0 is clearing
    save_sharded(model, optimizer, tmp / "trainer")
    rngs = gather(rng_state(), ranks)  # each rank's own: a rank's draws need not match rank 0's
    model_state = gather_state_dict(model)  # the export's full tensors, on rank 0
    writer.export(model, tokenizer, tmp / "model", model_state)
    state = {"step": step, "scheduler": scheduler.state_dict(), "rng": rngs, **(extra or {})}
    writer.save(state, tmp / "trainer_state.pt")
    writer.replace(tmp, final)
    barrier(ranks)  # no rank goes on (or reports the path) before the directory is complete
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
    ranks: Ranks,
) -> int:
    """Load trainable weights, optimizer, scheduler and RNG from a checkpoint into this rank's shards (a
    collective); returns its step. A run on more ranks than saved it gives the extra ranks rank 0's RNG."""
    if (Path(ckpt_dir) / "trainer" / ".metadata").is_file():
        load_sharded(model, optimizer, Path(ckpt_dir) / "trainer")
    else:
        _restore_full(model, optimizer, state, ckpt_dir)
    scheduler.load_state_dict(state["scheduler"])
    rngs: list[dict[str, Any]] = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
    set_rng_state(dict(enumerate(rngs)).get(ranks.rank, rngs[0]))
    return int(state["step"])


def _restore_full(model: Policy, optimizer: torch.optim.Optimizer, state: dict[str, Any], ckpt_dir: str | Path) -> None:
    """A checkpoint written before ``trainer/``: full weights (``model/``, or the LoRA tensors in the
    trainer state) and a full optimizer state dict, loaded into this rank's shards."""
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

"""Checkpoints: a Hugging Face model directory plus the trainer state needed for exact resume.

Layout: ``<output_dir>/checkpoints/step-000010/{model/, adapter/ (LoRA), trainer_state.pt}``.
A checkpoint directory is written under a temporary name and renamed when complete, so a crash
mid-save never leaves a half checkpoint that resume would pick.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from gspo_core.policy import save_hf

STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step-{step:06d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str | Path, step: int, model, tokenizer, optimizer, scheduler,
                    extra: dict | None = None) -> Path:
    """Write model + trainer state for ``step`` atomically; returns the step directory."""
    final = step_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tokenizer, tmp / "model")
    torch.save({
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "trainable": {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
        **(extra or {}),
    }, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_trainer_state(ckpt_dir: str | Path) -> dict:
    """The trainer state saved next to a checkpoint's model (optimizer, scheduler, RNG, step)."""
    return torch.load(Path(ckpt_dir) / "trainer_state.pt", map_location="cpu", weights_only=False)


def restore(model, optimizer, scheduler, state: dict) -> int:
    """Load trainable weights, optimizer, scheduler and RNG from ``state``; returns its step."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["trainable"].items():
            params[name].copy_(value.to(params[name].device))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])


def latest_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``step-*`` directory under ``output_dir/checkpoints``, if any."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))
             and (p / "trainer_state.pt").exists()]
    return str(max(steps)[1]) if steps else None

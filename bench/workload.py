"""The shared workload of both trainers: model shape, prompts, reward, sizes (equal work for both)."""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from gspo_core.toy import build_tiny_model, write_toy_dataset


@dataclass(frozen=True)
class Workload:
    """``steps`` GSPO steps of ``prompts`` x ``group`` completions of exactly ``tokens`` tokens
    (EOS ignored, so both trainers do equal work), ``updates`` optimizer updates per rollout batch."""

    shape: str = "toy"
    steps: int = 4
    prompts: int = 8
    group: int = 8
    tokens: int = 32
    updates: int = 4
    lr: float = 3e-3
    seed: int = 0
    fixed_length: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def similarity(text: str, target: str) -> float:
    """The toy task's reward (the same function as the `text_similarity` grader's fuzzy_match)."""
    return difflib.SequenceMatcher(None, text, target).ratio()


def prepare(w: Workload, root: Path) -> tuple[Path, Path]:
    """Build (once) the model of ``w.shape`` and the toy dataset; returns their paths."""
    model = build_tiny_model(root / f"model-{w.shape}", shape=w.shape, seed=0)
    data = write_toy_dataset(root / "toy.jsonl", n=256, seed=w.seed)
    return model, data

"""A cookbook-style loop over a TrainingSession, run by every rank (rank 0 drives, the others follow): the
two-rank test runs it under torchrun and in one process, and compares what rank 0 writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from gspo_core.primitives import AdamParams, Datum, TrainingSession


def rows() -> list[Datum]:
    """Five rows of uneven lengths (two ranks: a share of 3 and of 2, micro-batches that differ)."""
    data = []
    for i, length in enumerate([9, 4, 12, 6, 7]):
        tokens = [(7 * i + 3 * t) % 90 + 5 for t in range(length + 1)]
        weights = [0.0] * 2 + [1.0] * (length - 2)
        data.append(Datum(tokens[:-1], tokens[1:], weights=weights, advantages=[(i - 2) * w for w in weights]))
    return data


def loop(session: TrainingSession, out: Path) -> None:
    data, adam = rows(), AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
    metrics = []
    for _ in range(2):
        metrics.append(session.forward_backward(data, "cross_entropy").metrics)
        session.optim_step(adam)
        sampled = session.forward(data, "cross_entropy").logprobs  # as the sampler's: on-policy
        rl = [
            Datum(d.tokens, d.target_tokens, logprobs=lp, advantages=d.advantages)
            for d, lp in zip(data, sampled, strict=True)
        ]
        metrics.append(session.forward_backward(rl, "ppo").metrics)
        metrics.append(session.optim_step(adam))
    session.export_hf(str(out / "hf"))
    final = session.forward(data, "cross_entropy")
    (out / "result.json").write_text(json.dumps({"logprobs": final.logprobs, "metrics": metrics}))


def main(model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    session = TrainingSession.create(model_dir, device="cpu")
    if session.policy.ranks.main:
        loop(session, Path(out))
        session.close()
    else:
        session.follow()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

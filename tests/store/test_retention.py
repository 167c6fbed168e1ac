"""Checkpoint retention: the newest checkpoint and the best k of the others by validation are kept."""

from __future__ import annotations

from store.models import Checkpoint
from store.retention import outside_retention


def _ckpts(metrics_by_step: dict[int, dict]) -> list[Checkpoint]:
    return [Checkpoint(id=f"c{step}", step=step, metrics=m) for step, m in metrics_by_step.items()]


def test_keeps_newest_and_best_k_by_validation_reward():
    ckpts = _ckpts(
        {
            1: {"eval/reward/mean": 0.9},
            2: {"reward/mean": 1.0},  # no evaluation at this step
            3: {"eval/reward/mean": 0.2},
            4: {"eval/reward/mean": 0.5},
            5: {"eval/reward/mean": 0.5},
            6: {"eval/reward/mean": 0.1},
        }
    )
    assert sorted(c.step for c in outside_retention(ckpts, 2)) == [2, 3, 4]  # kept: 6 (newest), 1, 5 (tie: newer)
    assert sorted(c.step for c in outside_retention(ckpts, 0)) == [1, 2, 3, 4, 5]
    assert outside_retention(ckpts, 5) == []


def test_supervised_ranks_by_lowest_validation_loss_and_unevaluated_newest_first():
    ckpts = _ckpts({1: {"eval/loss": 0.3}, 2: {"eval/loss": 0.1}, 3: {"eval/loss": 0.2}, 4: {}})
    assert [c.step for c in outside_retention(ckpts, 1)] == [1, 3]
    plain = _ckpts({1: {}, 2: {}, 3: {}, 4: {}, 5: {}})
    assert [c.step for c in outside_retention(plain, 3)] == [1]

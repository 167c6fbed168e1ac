"""Reward specs: graders registered by name, built from JSON, scored concurrently per batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from gspo_core.rewards import graders as _graders  # noqa: F401  (registers the local graders)
from gspo_core.rewards import multi as _multi  # noqa: F401
from gspo_core.rewards import remote as _remote  # noqa: F401
from gspo_core.rewards.base import GRADERS, GradeResult, Grader, GraderError, RewardSpecError, build_grader, item_fields_of
from gspo_core.rewards.multi import MultiGrader

__all__ = ["GRADERS", "GradeResult", "GraderError", "RewardFunction", "RewardSpecError", "build_reward"]


class RewardFunction:
    """A built reward spec. A ``multi`` spec scores its sub-graders and combines them; any other
    spec is a single grader whose score is the reward. Grader errors score 0 and are recorded."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.root: Grader = build_grader(spec, "")
        self.parts: dict[str, Grader] = (
            self.root.subs if isinstance(self.root, MultiGrader) else {self.root.name: self.root}
        )
        self.grader_names = list(self.parts)
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.parts) * 2), thread_name_prefix="grader")

    def item_fields(self) -> set[str]:
        """Top-level dataset fields the spec's templates reference (checked at job submit)."""
        return item_fields_of(self.spec)

    def score_batch(self, items: list[dict], samples: list[dict]) -> list[GradeResult]:
        """Score ``samples[i]`` against ``items[i]``; graders run concurrently, each batched."""
        futures = {name: self._pool.submit(g.grade_batch, samples, items) for name, g in self.parts.items()}
        per_grader = {name: f.result() for name, f in futures.items()}
        results = []
        for k in range(len(samples)):
            scores, errors = {}, {}
            for name, outs in per_grader.items():
                value = outs[k]
                if isinstance(value, GraderError):
                    errors[name] = f"{value.kind}: {value}"
                    scores[name] = 0.0
                else:
                    scores[name] = float(value)
            reward = self._combine(scores, errors)
            results.append(GradeResult(reward=reward, scores=scores, errors=errors))
        return results

    def _combine(self, scores: dict[str, float], errors: dict[str, str]) -> float:
        if not isinstance(self.root, MultiGrader):
            return next(iter(scores.values()))
        try:
            return self.root.combine(scores)
        except GraderError as exc:
            errors["calculate_output"] = f"{exc.kind}: {exc}"
            return 0.0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.root.close()


def build_reward(spec: dict) -> RewardFunction:
    """Validate and build a reward spec; raises :class:`RewardSpecError` naming the bad field."""
    if not isinstance(spec, dict):
        raise RewardSpecError("reward", "must be a JSON object")
    return RewardFunction(spec)

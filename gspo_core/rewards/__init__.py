"""Reward specs: graders registered by name, built from JSON, scored concurrently per batch."""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

from gspo_core.rewards import graders as _graders  # noqa: F401  (registers the local graders)
from gspo_core.rewards import multi as _multi  # noqa: F401
from gspo_core.rewards import openenv_grader as _openenv  # noqa: F401
from gspo_core.rewards import python_grader as _python  # noqa: F401
from gspo_core.rewards import reasoning_gym_grader as _reasoning_gym  # noqa: F401
from gspo_core.rewards import remote as _remote  # noqa: F401
from gspo_core.rewards import reward_model as _reward_model  # noqa: F401
from gspo_core.rewards import verifiers_grader as _verifiers  # noqa: F401
from gspo_core.rewards.base import (
    GRADERS,
    Grader,
    GraderError,
    GradeResult,
    RewardSpecError,
    as_score,
    build_grader,
    check_spec_values,
    output_json,
    redact_secrets,
    sample_for,
)
from gspo_core.rewards.multi import MAX_MULTI_DEPTH, MultiGrader
from gspo_core.rewards.policy import DEFAULT_POLICY, GraderPolicy
from gspo_core.rewards.transcript import TranscriptError, check_transcript, transcript_sample
from gspo_core.stopping import NEVER, StepStopped, StopCheck

__all__ = [
    "DEFAULT_POLICY",
    "GRADERS",
    "GradeResult",
    "GraderError",
    "GraderPolicy",
    "RewardFunction",
    "RewardSpecError",
    "TranscriptError",
    "build_reward",
    "check_transcript",
    "map_reward_models",
    "output_json",
    "redact_secrets",
    "sample_for",
    "transcript_sample",
]

#: Threads for per-sample grader calls (mostly waiting on HTTP); sandboxes have their own pools.
MAX_THREADS = 32


class RewardFunction:
    """A built reward spec. A ``multi`` spec scores its sub-graders and combines them; any other
    spec is a single grader whose score is the reward. Grader errors score 0 and are recorded."""

    def __init__(self, spec: dict, policy: GraderPolicy = DEFAULT_POLICY) -> None:
        self.spec, self.policy = spec, policy
        self.root: Grader = build_grader(spec, "", policy)
        self.parts: dict[str, Grader] = (
            self.root.subs if isinstance(self.root, MultiGrader) else {self.root.name: self.root}
        )
        self.grader_names = list(self.parts)
        self._pool = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="grader")

    def local_models(self) -> dict[str, str]:
        """``{field: model}`` of every model the spec's graders load (``reward_model``)."""
        return self.root.local_models()

    def item_fields(self) -> set[str]:
        """Top-level dataset fields the spec's templates (given or default) reference."""
        return self.root.item_fields()

    def score_batch(self, items: list[dict], samples: list[dict], stop: StopCheck = NEVER) -> list[GradeResult]:
        """Score ``samples[i]`` against ``items[i]``. Every grader runs at once; per-sample graders
        also run every sample at once (bounded by the thread pool). A call that outlives its
        grader's budget is recorded as a timeout and not waited for. When ``stop`` says so, the wait ends
        (`StepStopped`) and the calls not started are cancelled."""
        if len(items) != len(samples):
            raise ValueError(f"{len(items)} items but {len(samples)} samples")
        n = len(samples)
        start = time.monotonic()
        futures: dict[str, list[Future] | Future] = {}
        for name, grader in self.parts.items():
            if grader.batched:
                futures[name] = self._pool.submit(grader.grade_batch, samples, items)
            else:
                futures[name] = [
                    self._pool.submit(grader.grade_one, sample, item)
                    for sample, item in zip(samples, items, strict=True)
                ]
        queued = sum(len(future) for future in futures.values() if isinstance(future, list))
        waves = max(1, math.ceil(queued / MAX_THREADS))  # calls queued behind others start later
        try:
            per_grader = {
                name: self._collect(self.parts[name], future, n, start, waves, stop) for name, future in futures.items()
            }
        except StepStopped:
            for future in futures.values():
                for one in future if isinstance(future, list) else [future]:
                    one.cancel()
            raise
        results = []
        for k in range(n):
            scores, errors = {}, {}
            for name, values in per_grader.items():
                value = values[k]
                if isinstance(value, GraderError):
                    errors[name] = f"{value.kind}: {value}"
                    scores[name] = 0.0
                else:
                    scores[name] = value
            results.append(GradeResult(reward=self._combine(scores, errors), scores=scores, errors=errors))
        return results

    def _collect(
        self, grader: Grader, future, n: int, start: float, waves: int, stop: StopCheck
    ) -> list[float | GraderError]:
        deadline = start + grader.budget_s(n) * (1 if grader.batched else waves)
        if isinstance(future, Future):
            return _checked(_wait(future, deadline, grader, n, stop), n)
        return [_checked(_wait(one, deadline, grader, 1, stop), 1)[0] for one in future]

    def _combine(self, scores: dict[str, float], errors: dict[str, str]) -> float:
        if not isinstance(self.root, MultiGrader):
            return next(iter(scores.values()))
        try:
            return self.root.combine(scores)
        except GraderError as exc:
            errors["calculate_output"] = f"{exc.kind}: {exc}"
            return 0.0

    def close(self) -> None:
        """Stop the thread pools, close HTTP clients and drop loaded reward models."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.root.close()


def _wait(future: Future, deadline: float, grader: Grader, n: int, stop: StopCheck = NEVER):
    """The future's value (a float, a GraderError or a list of them), or timeout errors."""
    try:
        value = stop.result(future, max(0.0, deadline - time.monotonic()))
    except StepStopped:
        raise
    except TimeoutError:
        future.cancel()
        err = GraderError("timeout", f"{grader.type_name} grader gave no result within {grader.budget_s(n):g} s")
        return [err] * n if grader.batched else err
    except Exception as exc:  # a batched grader that raised: every sample of the batch failed
        err = GraderError("exception", f"{type(exc).__name__}: {exc}"[:500])
        return [err] * n if grader.batched else err
    return value


def _checked(value, n: int) -> list[float | GraderError]:
    """Normalise to a list of finite floats / GraderErrors of length ``n``."""
    values = value if isinstance(value, list) else [value]
    if len(values) != n:
        return [GraderError("invalid_output", f"grader returned {len(values)} scores for {n} samples")] * n
    out: list[float | GraderError] = []
    for result in values:
        if isinstance(result, GraderError):
            out.append(result)
            continue
        try:
            out.append(as_score(result))
        except GraderError as exc:
            out.append(exc)
    return out


def build_reward(spec: dict, policy: GraderPolicy = DEFAULT_POLICY) -> RewardFunction:
    """Validate and build a reward spec under the operator's ``policy``; raises :class:`RewardSpecError`
    naming the bad field."""
    if not isinstance(spec, dict):
        raise RewardSpecError("reward", "must be a JSON object")
    check_spec_values(spec)
    return RewardFunction(spec, policy)


def map_reward_models(spec: dict, fn, _depth: int = 0) -> dict:
    """A copy of ``spec`` with each ``reward_model`` grader's ``model`` replaced by ``fn(model)``
    (the worker turns names under its models directory into paths this way). Below the deepest
    nesting a spec may have it leaves the spec as it is (building it then names the field)."""
    if not isinstance(spec, dict) or _depth > MAX_MULTI_DEPTH:
        return spec
    if spec.get("type") == "reward_model" and isinstance(spec.get("model"), str):
        return {**spec, "model": fn(spec["model"])}
    if spec.get("type") == "multi" and isinstance(spec.get("graders"), dict):
        return {**spec, "graders": {k: map_reward_models(v, fn, _depth + 1) for k, v in spec["graders"].items()}}
    return spec

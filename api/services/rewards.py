"""Reward specs at the API: build one (422 naming the field), check the models its graders load, and
dry-run one within the tenant's bounds."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Any

from api.errors import ApiError
from api.limits import Limits
from api.schemas import RewardRunIn, RewardRunOut, RewardRunResult
from gspo_core.rewards import (
    GraderPolicy,
    RewardFunction,
    RewardSpecError,
    TranscriptError,
    build_reward,
    check_transcript,
    map_reward_models,
    sample_for,
    transcript_sample,
)
from store.model_refs import ModelRefError, check_local_or_hub, resolve_model
from store.settings import Settings


def build_checked(spec: dict[str, Any], settings: Settings) -> RewardFunction:
    """The built spec, its ``reward_model`` names resolved under the models directory; 422 naming the
    field for a bad spec or a grader model outside the models policy (the one the trained model obeys)."""
    # The API's graders run below its own priority: a tenant's CPU-bound dry run leaves the cores to requests.
    policy = GraderPolicy.from_mapping({**settings.grader_policy(), "niceness": settings.dry_run_niceness})
    try:
        fn = build_reward(map_reward_models(spec, lambda m: resolve_model(settings.models_dir, m)), policy)
    except RewardSpecError as exc:
        raise ApiError(422, "invalid_reward", str(exc), f"reward.{exc.field}" if exc.field else "reward") from None
    for field, model in fn.local_models().items():
        try:
            check_local_or_hub(settings, model)
        except ModelRefError as exc:
            fn.close()
            raise ApiError(422, "invalid_reward", f"reward.{field}: {exc}", f"reward.{field}") from None
    return fn


def _samples(req: RewardRunIn) -> list[dict]:
    """The graders' ``sample`` of each text (one turn, as the trainer's sample has it), or of the transcript
    (read as the trainer reads an episode's)."""
    if req.messages is None:
        if not req.samples:
            raise ApiError(422, "invalid_request", "samples: give at least one text, or `messages`", "samples")
        return [sample_for(t, len(t)) for t in req.samples]
    if req.samples:
        raise ApiError(422, "invalid_request", "give either `samples` or `messages`, not both", "messages")
    try:
        check_transcript(req.messages)
    except TranscriptError as exc:
        raise ApiError(422, "invalid_request", str(exc), exc.field) from None
    return [transcript_sample(req.messages)]


def _grade(req: RewardRunIn, settings: Settings) -> RewardRunOut:
    samples = _samples(req)
    fn = build_checked(req.reward, settings)
    try:
        results = fn.score_batch([req.item] * len(samples), samples)
    finally:
        fn.close()
    return RewardRunOut(
        grader_names=fn.grader_names,
        results=[
            RewardRunResult(output_text=sample["output_text"], reward=r.reward, scores=r.scores, errors=r.errors)
            for sample, r in zip(samples, results, strict=True)
        ],
    )


async def dry_run(limits: Limits, pool: Executor, settings: Settings, tenant_id: str, req: RewardRunIn) -> RewardRunOut:
    """Grade ``req`` (reward, item, samples) on ``pool`` (this process's grading threads, as many as
    its dry-run slots) within the bounds: samples per call (422), the tenant's grading time per window
    and concurrent runs (429), this process's runs (503)."""
    if len(req.samples) > settings.max_reward_run_samples:
        raise ApiError(
            422, "invalid_request", f"samples: at most {settings.max_reward_run_samples} per call", "samples"
        )
    what, window = "reward runs", settings.reward_run_window_s
    await limits.check_budget(what, tenant_id, settings.reward_run_budget_s, window)
    async with limits.slot(what, tenant_id, settings.max_reward_runs_per_tenant, settings.max_reward_runs_per_process):
        start = time.monotonic()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, _grade, req, settings)
        finally:
            await limits.charge(what, tenant_id, time.monotonic() - start, window)

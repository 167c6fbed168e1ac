"""POST /v1/rewards/run: score a grader spec on an item and sample texts, without a GPU."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from api.deps import TenantDep
from api.errors import ApiError
from api.schemas import ErrorBody, RewardRunIn, RewardRunOut, RewardRunResult
from gspo_core.rewards import RewardSpecError, build_reward

router = APIRouter(prefix="/v1/rewards", tags=["rewards"])


def _run(req: RewardRunIn) -> RewardRunOut:
    try:
        fn = build_reward(req.reward)
    except RewardSpecError as exc:
        raise ApiError(422, "invalid_reward", str(exc), f"reward.{exc.field}") from None
    try:
        samples = [{"output_text": t, "output_tokens": len(t), "finish_reason": "stop"} for t in req.samples]
        results = fn.score_batch([req.item] * len(samples), samples)
    finally:
        fn.close()
    return RewardRunOut(grader_names=fn.grader_names, results=[
        RewardRunResult(output_text=t, reward=r.reward, scores=r.scores, errors=r.errors)
        for t, r in zip(req.samples, results)])


@router.post("/run", response_model=RewardRunOut, responses={401: {"model": ErrorBody}, 422: {"model": ErrorBody}})
async def run_reward(req: RewardRunIn, tenant: TenantDep):
    return await asyncio.to_thread(_run, req)

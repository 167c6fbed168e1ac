"""POST /v1/rewards/run: score a grader spec on an item and sample texts, without a GPU."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from api.deps import SettingsDep, TenantDep
from api.schemas import ErrorBody, RewardRunIn, RewardRunOut, RewardRunResult
from api.services.rewards import build_checked
from store.settings import Settings

router = APIRouter(prefix="/v1/rewards", tags=["rewards"])


def _run(req: RewardRunIn, settings: Settings) -> RewardRunOut:
    fn = build_checked(req.reward, settings)
    try:
        samples = [{"output_text": t, "output_tokens": len(t), "finish_reason": "stop"} for t in req.samples]
        results = fn.score_batch([req.item] * len(samples), samples)
    finally:
        fn.close()
    return RewardRunOut(grader_names=fn.grader_names, results=[
        RewardRunResult(output_text=t, reward=r.reward, scores=r.scores, errors=r.errors)
        for t, r in zip(req.samples, results)])


@router.post("/run", response_model=RewardRunOut, responses={401: {"model": ErrorBody}, 422: {"model": ErrorBody}})
async def run_reward(req: RewardRunIn, tenant: TenantDep, settings: SettingsDep):
    return await asyncio.to_thread(_run, req, settings)

"""POST /v1/rewards/run: score a grader spec on an item and sample texts, without a GPU."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.bodies import StrictJsonRoute
from api.deps import LimitsDep, SettingsDep, TenantDep
from api.schemas import ErrorBody, RewardRunIn, RewardRunOut, json_response
from api.services.rewards import dry_run

router = APIRouter(prefix="/v1/rewards", tags=["rewards"], route_class=StrictJsonRoute)
ERRORS = {code: {"model": ErrorBody} for code in (401, 422, 429, 503)}


@router.post("/run", response_model=RewardRunOut, responses=ERRORS)
async def run_reward(req: RewardRunIn, tenant: TenantDep, settings: SettingsDep, limits: LimitsDep, request: Request):
    """Bounded per tenant: GSPO_MAX_REWARD_RUNS_PER_TENANT at once and GSPO_REWARD_RUN_BUDGET_S of grading
    per GSPO_REWARD_RUN_WINDOW_S (429 with Retry-After past either)."""
    out = await dry_run(
        limits,
        request.app.state.grading_pool,
        settings,
        tenant.id,
        req.model_dump(mode="json", include={"reward", "item", "samples"}),
    )
    return json_response(RewardRunOut.model_validate(out))

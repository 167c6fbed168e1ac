"""POST /v1/rewards/run: score a grader spec on an item and sample texts, without a GPU."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api.bodies import StrictJsonRoute
from api.deps import GradingPoolDep, LimitsDep, SettingsDep, TenantDep
from api.schemas import RewardRunIn, RewardRunOut, error_responses, json_response
from api.services.rewards import dry_run

router = APIRouter(prefix="/v1/rewards", tags=["rewards"], route_class=StrictJsonRoute)
ERRORS = error_responses(401, 422, 429, 503)


@router.post("/run", response_model=RewardRunOut, responses=ERRORS)
async def run_reward(
    req: RewardRunIn, tenant: TenantDep, settings: SettingsDep, limits: LimitsDep, pool: GradingPoolDep
) -> Response:
    """Bounded per tenant: GSPO_MAX_REWARD_RUNS_PER_TENANT at once and GSPO_REWARD_RUN_BUDGET_S of grading
    per GSPO_REWARD_RUN_WINDOW_S (429 with Retry-After past either)."""
    return json_response(await dry_run(limits, pool, settings, tenant.id, req))

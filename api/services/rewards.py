"""Reward specs at the API: build one (422 naming the field), check the models its graders load, score one."""

from __future__ import annotations

from api.errors import ApiError
from gspo_core.rewards import GraderPolicy, RewardFunction, RewardSpecError, build_reward, map_reward_models
from store.model_refs import ModelRefError, check_local_or_hub, resolve_model
from store.settings import Settings


def build_checked(spec: dict, settings: Settings) -> RewardFunction:
    """The built spec, its ``reward_model`` names resolved under the models directory; 422 naming the
    field for a bad spec or a grader model outside the models policy (the one the trained model obeys)."""
    try:
        fn = build_reward(map_reward_models(spec, lambda m: resolve_model(settings.models_dir, m)),
                          GraderPolicy.from_mapping(settings.grader_policy()))
    except RewardSpecError as exc:
        raise ApiError(422, "invalid_reward", str(exc), f"reward.{exc.field}" if exc.field else "reward") from None
    for field, model in fn.local_models().items():
        try:
            check_local_or_hub(settings, model)
        except ModelRefError as exc:
            fn.close()
            raise ApiError(422, "invalid_reward", f"reward.{field}: {exc}", f"reward.{field}") from None
    return fn

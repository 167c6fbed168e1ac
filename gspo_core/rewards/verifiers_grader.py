"""The ``verifiers`` grader: an episode's own score from its verifiers environment (its rubric's reward)."""

from __future__ import annotations

from gspo_core.rewards.base import Grader, GraderError, RewardSpecError, register
from gspo_core.rewards.policy import DEFAULT_POLICY


@register("verifiers")
class VerifiersGrader(Grader):
    """``score``: ``reward`` (default) the weighted sum of the task's ``@vf.reward`` functions, as verifiers
    computes a trace's reward; else the name of one ``@vf.reward`` or ``@vf.metric`` (its unweighted value).
    Only the episodes of a job on a ``verifiers`` environment carry them (`sample.environment`); elsewhere (a dry
    run) it is a ``no_environment`` error, scoring 0."""

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"score"})
        self.score = self.opt("score", str, "reward")
        if not self.score or len(self.score) > 100:
            raise RewardSpecError(self.field("score"), "a score name of 1 to 100 characters")

    def grade(self, sample, item):
        env = sample.get("environment")
        if not isinstance(env, dict):
            raise GraderError("no_environment", "only a verifiers environment's episodes carry its scores")
        value = env.get("reward") if self.score == "reward" else (env.get("metrics") or {}).get(self.score)
        if value is None:
            raise GraderError("no_score", f"the episode has no score {self.score!r}")
        return float(value)

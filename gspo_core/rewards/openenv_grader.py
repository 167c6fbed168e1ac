"""The ``openenv`` grader: the reward of an OpenEnv job, which its server gives each episode (no grading here)."""

from __future__ import annotations

from gspo_core.rewards.base import Grader, GraderError, register
from gspo_core.rewards.policy import DEFAULT_POLICY


@register("openenv")
class OpenEnvGrader(Grader):
    """Stands for the server's reward in an ``openenv`` job's spec (`gspo_core.environments.openenv`): every
    episode that is not dropped carries its reward, which the trainer takes as given, so this grader is never
    asked for one there; anywhere else (a job on files, `/v1/rewards/run`) a sample has no server's reward and
    is an error."""

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys(set())

    def grade(self, sample, item):
        raise GraderError("missing_field", "only an openenv job's episodes carry the server's reward")

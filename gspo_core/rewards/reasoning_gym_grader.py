"""The ``reasoning_gym`` grader: the item's reasoning-gym task scores the answer with its own ``score_answer``."""

from __future__ import annotations

from gspo_core.rewards.base import RewardSpecError, register, render
from gspo_core.rewards.policy import DEFAULT_POLICY
from gspo_core.rewards.pool import Killable

#: How the answer is read from the completion (`gspo_core.environments.reasoning_gym.extract_answer`).
EXTRACT_MODES = ("auto", "answer_tag", "number", "none")


@register("reasoning_gym")
class ReasoningGymGrader(Killable):
    """Scores ``input`` (default the completion) with the scorer of the item's ``task`` (reasoning-gym's own
    ``score_answer``, built with the item's ``task_config``), reading the answer as ``extract`` says: ``auto``
    the last ``<answer>`` tags, else the last non-empty line; ``answer_tag`` only tags (none: no answer, 0);
    ``number`` the tags, else the last number in the text; ``none`` the whole text. Killable: a task's scorer
    is third-party code (some run sympy)."""

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"input", "extract"})
        self.input = self.tmpl("input", "{{sample.output_text}}")
        self.extract = self.opt("extract", str, "auto")
        if self.extract not in EXTRACT_MODES:
            raise RewardSpecError(self.field("extract"), f"one of {', '.join(EXTRACT_MODES)}")
        try:
            import reasoning_gym  # noqa: F401  (the scorers' library, here only to refuse a spec it cannot grade)
        except ImportError:
            raise RewardSpecError(self.field("type"), "the reasoning-gym package is not installed here") from None
        self.start_pool()

    def item_fields(self) -> set[str]:
        return super().item_fields() | {"task", "answer"}

    def grade(self, sample, item):
        from gspo_core.environments import reasoning_gym

        answer = reasoning_gym.extract_answer(render(self.input, sample, item), self.extract)
        return reasoning_gym.score(answer, item)

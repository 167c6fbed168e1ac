"""How the trainer talks to the outside (worker persistence, CLI printing): a callbacks object."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal


@dataclass(frozen=True)
class Evaluation:
    """A held-out evaluation ``before`` the first step (step 0) or ``after`` the last: the mean reward of
    greedy completions (greedy accuracy, for 0/1 rewards) and of sampled ones over ``prompts`` prompts; a
    supervised job's is its ``loss`` instead."""

    when: Literal["before", "after"]
    step: int
    prompts: int
    greedy_reward: float | None = None
    sampled_reward: float | None = None
    loss: float | None = None

    @classmethod
    def of(cls, when: Literal["before", "after"], step: int, prompts: int, metrics: dict[str, float]) -> Evaluation:
        """The summary of an evaluation's metrics (`gspo_core.gspo_loop.evaluate`'s names)."""
        return cls(
            when,
            step,
            prompts,
            metrics.get("eval/greedy/reward/mean"),
            metrics.get("eval/reward/mean"),
            metrics.get("eval/loss"),
        )

    def as_dict(self) -> dict:
        return asdict(self)


class Callbacks:
    """No-op base; override what you need. All methods are called from the training thread.

    ``on_samples`` rows: ``{"prompt", "item", "completions": [{"text", "reward", "scores",
    "errors", "tokens", "finish_reason"}]}``. ``should_stop`` is polled before every step and, while a
    step waits on tools, agents or graders, about once a second (`gspo_core.stopping`); when it returns True,
    or ``deadline()`` (a `time.monotonic` value; None: none) has passed, the step in flight is dropped, the
    trainer saves a checkpoint of the last completed step and returns with ``stopped=True``.
    """

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def on_samples(self, step: int, rows: list[dict]) -> None:
        pass

    def on_checkpoint(self, step: int, path: str, final: bool) -> None:
        pass

    def on_log(self, message: str) -> None:
        pass

    def on_evaluation(self, evaluation: Evaluation) -> None:
        """The held-out evaluation before the first step or after the last (besides its step's metrics)."""

    def should_stop(self) -> bool:
        return False

    def deadline(self) -> float | None:
        return None


class CallbackList(Callbacks):
    """Fans every call out to several callbacks (e.g. metrics file + progress bar)."""

    def __init__(self, *callbacks: Callbacks) -> None:
        self.callbacks = [callback for callback in callbacks if callback is not None]

    def on_step(self, step, metrics):
        for callback in self.callbacks:
            callback.on_step(step, metrics)

    def on_samples(self, step, rows):
        for callback in self.callbacks:
            callback.on_samples(step, rows)

    def on_checkpoint(self, step, path, final):
        for callback in self.callbacks:
            callback.on_checkpoint(step, path, final)

    def on_log(self, message):
        for callback in self.callbacks:
            callback.on_log(message)

    def on_evaluation(self, evaluation):
        for callback in self.callbacks:
            callback.on_evaluation(evaluation)

    def should_stop(self):
        return any(callback.should_stop() for callback in self.callbacks)

    def deadline(self):
        return min((d for callback in self.callbacks if (d := callback.deadline()) is not None), default=None)

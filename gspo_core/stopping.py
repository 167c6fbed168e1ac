"""Stopping inside a step: a deadline and a stop poll that the episode loop, the tools, the agent and the graders
check while they wait, so a cancel, a pause or a limit need not wait for a slow tool or agent to finish its step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

#: How often a wait inside a step asks its owner whether to stop (each ask may cost a database query).
POLL_S = 1.0
#: The longest single wait between two looks at the deadline and the stop poll.
SLICE_S = 0.1


class StepStopped(Exception):
    """The step in flight was asked to stop (a cancel, a pause, a limit): its half-done rollout is dropped and
    the run ends at the last completed step."""


class StopCheck:
    """When the step in flight must end: ``deadline`` (a `time.monotonic` value; None: none) or ``poll()``
    (the owner's own question, e.g. the job's status; asked at most every ``poll_s`` seconds, on the thread
    that waits). Once either says stop, it stays stopped."""

    def __init__(
        self, poll: Callable[[], bool] | None = None, deadline: float | None = None, poll_s: float = POLL_S
    ) -> None:
        self.poll, self.deadline, self.poll_s = poll, deadline, poll_s
        self._asked = time.monotonic()  # the step began with a poll (`Trainer.should_stop`)
        self._stopped = False
        self._lock = threading.Lock()

    def left(self) -> float | None:
        """Seconds until the deadline (None: no deadline; never below 0)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def clip(self, timeout: float) -> float:
        """``timeout`` cut to the time left."""
        left = self.left()
        return timeout if left is None else min(timeout, left)

    def stopped(self) -> bool:
        """True once the deadline passed or the poll said stop (a deadline's passing is told to the poll at
        once, so its owner records why)."""
        with self._lock:
            if self._stopped:
                return True
            now = time.monotonic()
            past = self.deadline is not None and now >= self.deadline
            if self.poll is not None and (past or now - self._asked >= self.poll_s):
                self._asked = now
                self._stopped = bool(self.poll())
            self._stopped = self._stopped or past
            return self._stopped

    def check(self) -> None:
        """Raise `StepStopped` when the step must end."""
        if self.stopped():
            raise StepStopped("the step was stopped")

    def result(self, future: Future, timeout: float) -> Any:
        """``future.result(timeout)``, raising `StepStopped` as soon as the step must end."""
        if self.poll is None and self.deadline is None:
            return future.result(timeout=None if timeout == float("inf") else timeout)
        end = time.monotonic() + timeout
        while True:
            self.check()
            try:
                return future.result(timeout=max(0.0, min(SLICE_S, end - time.monotonic())))
            except FutureTimeout:
                if time.monotonic() >= end:
                    raise

    def wait_for(self, cv: threading.Condition, predicate: Callable[[], bool], timeout: float) -> bool:
        """``cv.wait_for(predicate, timeout)`` (the caller holds ``cv``), ending early, False, when the step must
        stop (the caller then calls `check`, or gives up waiting where it cleans up)."""
        end = time.monotonic() + timeout
        while not predicate():
            left = end - time.monotonic()
            if left <= 0 or self.stopped():
                return False
            cv.wait(min(SLICE_S, left))
        return True


#: The check of a run that nothing stops mid-step (`gspo train` without callbacks, tests).
NEVER = StopCheck()

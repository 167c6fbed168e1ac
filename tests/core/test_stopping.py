"""A step's waits end when its stop check says so: on graders and tools held by a real slow server on loopback."""

from __future__ import annotations

import time

import pytest

from gspo_core.agents import build_toolbox
from gspo_core.agents.formats import ToolCall
from gspo_core.rewards import build_reward
from gspo_core.stopping import StepStopped, StopCheck
from tests.core.test_rewards_remote import LOCAL, _Handler, sample, server  # noqa: F401 (server: the fixture)


def test_a_deadline_ends_the_wait_for_a_slow_grader_and_its_owner_is_told(server):  # noqa: F811
    _Handler.delay = 20.0
    asked: list[float] = []
    fn = build_reward({"type": "http", "name": "h", "url": server + "/score", "timeout_s": 60, "retries": 0}, LOCAL)
    try:
        stop = StopCheck(lambda: asked.append(time.monotonic()) or False, deadline=time.monotonic() + 0.5, poll_s=60)
        t0 = time.monotonic()
        with pytest.raises(StepStopped):
            fn.score_batch([{}] * 4, [sample("abcd")] * 4, stop)
        assert time.monotonic() - t0 < 2.0, "stopped at the deadline, not after the grader's 20 s"
        assert len(asked) == 1 and asked[0] - t0 >= 0.5, "the deadline's passing was told to the poll once"
        assert stop.stopped() and stop.left() == 0.0 and stop.clip(5.0) == 0.0
    finally:
        fn.close()


def test_a_poll_that_says_stop_ends_the_wait_for_slow_tool_calls(server):  # noqa: F811
    _Handler.delay = 20.0
    box = build_toolbox([{"type": "http", "name": "slow", "server_url": server + "/plain", "timeout_s": 60}], LOCAL)
    assert box is not None
    try:
        t0 = time.monotonic()
        stop = StopCheck(lambda: time.monotonic() - t0 > 0.5, poll_s=0.1)
        with pytest.raises(StepStopped):
            box.call_many([ToolCall("slow", {})] * 3, [1, 2, 3], stop=stop)
        assert time.monotonic() - t0 < 2.0, "stopped at the poll's answer, not after the tool's 20 s"
        _Handler.delay = 0.0  # without a stop the same calls are waited for
        assert [r.error for r in box.call_many([ToolCall("slow", {})] * 2, [4, 5])] == [None, None]
    finally:
        box.close()

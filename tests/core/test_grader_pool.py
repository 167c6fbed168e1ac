"""Graders that run third-party or user-shaped computation grade in the killable grader pool: a sample
that never yields scores 0 with a timeout, the batch returns within its budget, a stuck process is
killed and replaced, and the processes are capped and die with their parent (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_core.rewards import GraderPolicy, build_reward
from gspo_core.rewards.pool import GRACE_S, pool_for

#: Seconds a pooled sample may run in these tests (the default is 5).
FAST = GraderPolicy(local_timeout_s=1.0, local_budget_s=60.0)
SLOW_MATH = "so \\boxed{(x+1)^{99999}}"  # sympy expands it for minutes (in Python: the alarm stops it)
BACKTRACK = '"' + "a" * 40 + '!"'  # ^(a+)+$ on it: 2^40 steps in re's C loop


def sample(text: str) -> dict:
    return {"output_text": text, "output_tokens": len(text), "finish_reason": "stop"}


SPEC = {
    "type": "multi",
    "graders": {
        "math": {"type": "math_answer", "reference": "{{item.answer}}"},
        "schema": {"type": "json_schema", "schema": {"type": "string", "pattern": "^(a+)+$"}},
        "fuzzy": {"type": "text_similarity", "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"},
    },
}


def _ready(policy: GraderPolicy, holding: str | None = None, timeout: float = 120.0) -> list[int]:
    """The pool's process ids once all are started (and hold the spec ``holding``)."""
    pool = pool_for(policy)
    pool.start()
    deadline = time.monotonic() + timeout
    while len(pool.pids(holding)) < pool.size:
        assert time.monotonic() < deadline, "grader pool did not start"
        time.sleep(0.05)
    return pool.pids()


def test_samples_that_never_yield_score_a_timeout_and_the_next_batch_works():
    fn = build_reward(SPEC, FAST)
    try:
        for part in fn.parts.values():
            _ready(FAST, holding=part.pool_key)
        t0 = time.monotonic()
        res = fn.score_batch(
            [{"answer": "1"}, {"answer": "0.5"}, {"answer": "x"}],
            [sample(SLOW_MATH), sample("\\boxed{\\frac{1}{2}}"), sample(BACKTRACK)],
        )
        elapsed = time.monotonic() - t0
        assert res[0].errors["math"].startswith("timeout") and res[0].scores["math"] == 0.0
        assert res[2].errors["schema"].startswith("timeout") and res[2].scores["schema"] == 0.0
        assert res[1].scores["math"] == 1.0 and not res[1].errors
        assert elapsed < 2 * (FAST.local_timeout_s + GRACE_S) + 5, elapsed  # not the minutes they would take
        tower = fn.score_batch([{"answer": "1"}], [sample("\\boxed{9^{9^{9}}}")])[0]  # refused before sympy
        assert tower.errors["math"].startswith("invalid_output") and "too large" in tower.errors["math"]
        again = fn.score_batch([{"answer": "4"}] * 2, [sample("\\boxed{4}"), sample('"aaaa"')])
        assert again[0].scores == {"math": 1.0, "schema": 0.0, "fuzzy": pytest.approx(2 / 10)} and not again[0].errors
        assert again[1].scores["schema"] == 1.0 and not again[1].errors
    finally:
        fn.close()


def test_a_batch_returns_within_its_budget_however_many_samples_hang():
    policy = GraderPolicy(local_timeout_s=1.0, local_budget_s=3.0)
    fn = build_reward({"type": "math_answer", "name": "m", "reference": "1"}, policy)
    try:
        _ready(policy, holding=fn.root.pool_key)
        t0 = time.monotonic()
        res = fn.score_batch([{}] * 12, [sample(SLOW_MATH)] * 12)
        elapsed = time.monotonic() - t0
        assert elapsed < policy.local_budget_s + 2 * GRACE_S + 3, elapsed  # 12 s if every sample ran its second
        assert all(r.reward == 0.0 and r.errors["m"].startswith("timeout") for r in res)
        assert any("budget ran out" in r.errors["m"] for r in res)
        _ready(policy, holding=fn.root.pool_key)  # processes stopped at the deadline were replaced, warm
        assert fn.score_batch([{}], [sample("\\boxed{1}")])[0].reward == 1.0
    finally:
        fn.close()


def test_a_process_that_stops_answering_is_killed_and_replaced():
    policy = GraderPolicy(local_timeout_s=1.0, pool_size=2, pool_memory_mb=768)  # a pool of its own
    fn = build_reward({"type": "json_schema", "name": "j", "schema": {"type": "object"}}, policy)
    try:
        before = _ready(policy, holding=fn.root.pool_key)  # the spec was given to every process at build
        for pid in before:
            os.kill(pid, signal.SIGSTOP)  # a process stuck where no alarm reaches it
        t0 = time.monotonic()
        texts = ["{}", "[]"] * 8  # chunks of 2: each stopped process gets one, its second sample goes elsewhere
        res = fn.score_batch([{}] * 16, [sample(t) for t in texts])
        assert time.monotonic() - t0 < 2 * (policy.local_timeout_s + GRACE_S) + 10
        stuck = [k for k, r in enumerate(res) if r.errors]
        assert len(stuck) == 2 and all(
            "timeout" in res[k].errors["j"] and "stopped" in res[k].errors["j"] for k in stuck
        ), [r.errors for r in res]
        assert all(r.reward == (1.0 if texts[k] == "{}" else 0.0) for k, r in enumerate(res) if k not in stuck)
        after = _ready(policy)
        assert not set(before) & set(after)
        for pid in before:  # killed and reaped, not left stopped
            assert not os.path.exists(f"/proc/{pid}") or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        assert [r.reward for r in fn.score_batch([{}] * 2, [sample("{}"), sample("[]")])] == [1.0, 0.0]
    finally:
        fn.close()


def test_pool_processes_have_a_memory_cap():
    for pid in _ready(FAST):
        limits = Path(f"/proc/{pid}/limits").read_text()
        line = next(ln for ln in limits.splitlines() if ln.startswith("Max address space"))
        assert line.split()[3] != "unlimited", line


def test_pool_processes_die_with_their_parent(tmp_path):
    code = (
        "import time\nfrom gspo_core.rewards import build_reward\nfrom gspo_core.rewards.pool import pool_for\n"
        "fn = build_reward({'type': 'math_answer', 'reference': '1'})\n"
        "print(fn.score_batch([{}], [{'output_text': '1', 'output_tokens': 1, 'finish_reason': 'stop'}])[0].reward)\n"
        "print(*pool_for(fn.root.policy).pids(), flush=True)\ntime.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    try:
        assert proc.stdout.readline().strip() == "1.0"
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, "pool processes outlived their parent"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False

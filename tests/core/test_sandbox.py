"""The `python` grader's sandbox, attacked for real: secrets, fork bomb, infinite loop, memory hog."""

from __future__ import annotations

import os
import time

import pytest

from gspo_core.rewards import build_reward


def run(source: str, texts, env: dict | None = None, **limits):
    fn = build_reward({"type": "python", "name": "py", "source": source, **limits})
    try:
        samples = [{"output_text": t, "output_tokens": len(t), "finish_reason": "stop"} for t in texts]
        return fn.score_batch([{"answer": "x"}] * len(texts), samples)
    finally:
        fn.close()


def test_user_grader_scores():
    res = run("def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])", ["x", "y"])
    assert [r.reward for r in res] == [1.0, 0.0]


def test_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://admin:hunter2@db/prod")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "topsecret")
    monkeypatch.setenv("GSPO_API_KEY", "gspo_secret")
    src = (
        "import os\n"
        "def grade(sample, item):\n"
        "    leaked = [k for k in ('DATABASE_URL', 'AWS_SECRET_ACCESS_KEY', 'GSPO_API_KEY') if k in os.environ]\n"
        "    try:\n"
        f"        leaked.append(open('/proc/{os.getpid()}/environ').read())\n"
        "    except OSError:\n"
        "        pass\n"
        "    return 1.0 if leaked else 0.5\n"
    )
    res = run(src, ["a"])
    assert res[0].reward == 0.5 and not res[0].errors


def test_infinite_loop_times_out_and_next_sample_is_scored():
    src = "def grade(sample, item):\n    if sample['output_text'] == 'loop':\n        while True: pass\n    return 1.0"
    t0 = time.perf_counter()
    res = run(src, ["loop", "fine"], timeout_s=0.5)
    assert time.perf_counter() - t0 < 10
    assert res[0].reward == 0.0 and res[0].errors["py"].startswith("timeout")
    assert res[1].reward == 1.0 and not res[1].errors


def test_memory_hog_is_stopped():
    src = "def grade(sample, item):\n    x = bytearray(2 * 1024 ** 3)\n    return 1.0"
    res = run(src, ["a"], memory_mb=256)
    assert res[0].reward == 0.0 and res[0].errors["py"].startswith("memory")


def test_fork_bomb_is_contained():
    src = ("import os\n"
           "def grade(sample, item):\n"
           "    n = 0\n"
           "    while True:\n"
           "        if os.fork() == 0:\n"
           "            import time; time.sleep(30); os._exit(0)\n"
           "        n += 1\n")
    t0 = time.perf_counter()
    res = run(src, ["a", "b"], timeout_s=1.0)
    assert time.perf_counter() - t0 < 30
    assert all(r.reward == 0.0 and r.errors for r in res)
    again = run("def grade(sample, item):\n    return 2.0", ["a"])
    assert again[0].reward == 2.0, "the worker carries on after the bomb"


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_no_network():
    src = ("import socket\n"
           "def grade(sample, item):\n"
           "    try:\n"
           "        socket.create_connection(('127.0.0.1', 6379), timeout=1)\n"
           "        return 1.0\n"
           "    except OSError:\n"
           "        return 0.25\n")
    assert run(src, ["a"])[0].reward == 0.25


def test_bad_output_and_exceptions_are_recorded():
    res = run("def grade(sample, item):\n    if sample['output_text'] == 'a': raise ValueError('boom')\n    return 'nan?'",
              ["a", "b"])
    assert res[0].errors["py"].startswith("exception") and "boom" in res[0].errors["py"]
    assert res[1].errors["py"].startswith("invalid_output")

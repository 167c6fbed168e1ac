"""The `python` grader's sandbox, attacked for real: secrets, fork bomb, infinite loops, memory hog,
escaping the process group, big files, network; the worker carries on after each."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from gspo_core.rewards import build_reward
from gspo_core.rewards.sandbox import IS_ROOT, SLOTS, UID_BASE, _uid_alive

needs_root = pytest.mark.skipif(not IS_ROOT, reason="uid switch and network namespace need root")
OK = "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n"


def samples(texts):
    return [{"output_text": t, "output_tokens": len(t), "finish_reason": "stop"} for t in texts]


def run(source: str, texts, items=None, **limits):
    fn = build_reward({"type": "python", "name": "py", "source": source, **limits})
    try:
        return fn.score_batch(items or [{"answer": "x"}] * len(texts), samples(texts))
    finally:
        fn.close()


def no_sandbox_processes_left() -> bool:
    uids = range(UID_BASE + os.getpid() * SLOTS, UID_BASE + (os.getpid() + 1) * SLOTS)
    return not any(_uid_alive(u) for u in uids)


def test_user_grader_scores_and_sees_sample_and_item():
    res = run(OK, ["x", "y", "x"])
    assert [r.reward for r in res] == [1.0, 0.0, 1.0] and not any(r.errors for r in res)


def test_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://admin:hunter2@db/prod")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "topsecret")
    monkeypatch.setenv("GSPO_S3_SECRET_ACCESS_KEY", "s3secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-live")
    src = (
        "import os\n"
        "def grade(sample, item):\n"
        "    env = dict(os.environ)\n"
        "    if set(env) - {'PATH', 'LANG', 'HOME', 'PYTHONDONTWRITEBYTECODE', 'LC_CTYPE'}:\n"
        "        return 9.0\n"
        "    for path in ['/proc/%d/environ' % item['parent'], '/proc/1/environ', '/proc/self/environ',\n"
        "                 '/etc/shadow']:\n"
        "        try:\n"
        "            data = open(path, 'rb').read()\n"
        "        except OSError:\n"
        "            continue\n"
        "        if b'hunter2' in data or b'topsecret' in data or b'sk-live' in data or b'root:' in data:\n"
        "            return 1.0\n"
        "    return 0.5\n"
    )
    res = run(src, ["a"], items=[{"parent": os.getpid()}])
    assert res[0].reward == 0.5 and not res[0].errors


def test_infinite_loop_times_out_and_next_sample_is_scored():
    src = OK.replace("    return", "    if sample['output_text'] == 'loop':\n        while True: pass\n    return")
    t0 = time.perf_counter()
    res = run(src, ["loop", "x", "y"], timeout_s=0.5)
    assert time.perf_counter() - t0 < 10
    assert res[0].reward == 0.0 and res[0].errors["py"].startswith("timeout")
    assert [r.reward for r in res[1:]] == [1.0, 0.0] and not res[1].errors and not res[2].errors


def test_loop_that_ignores_the_alarm_is_killed():
    src = ("import signal\n"
           "def grade(sample, item):\n"
           "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
           "    if sample['output_text'] == 'loop':\n"
           "        while True:\n"
           "            try:\n"
           "                pass\n"
           "            except BaseException:\n"
           "                pass\n"
           "    return 1.0\n")
    t0 = time.perf_counter()
    res = run(src, ["loop", "fine"], timeout_s=0.5)
    assert time.perf_counter() - t0 < 20
    assert res[0].reward == 0.0 and res[0].errors["py"].startswith("timeout")
    assert res[1].reward == 1.0 and not res[1].errors


def test_memory_hog_is_stopped():
    src = "def grade(sample, item):\n    x = bytearray(2 * 1024 ** 3)\n    return 1.0"
    res = run(src, ["a"], memory_mb=256)
    assert res[0].reward == 0.0 and res[0].errors["py"].startswith("memory")
    assert run(OK, ["x"], memory_mb=256)[0].reward == 1.0


@needs_root
def test_fork_bomb_is_contained_and_reaped():
    src = ("import os, time\n"
           "def grade(sample, item):\n"
           "    while True:\n"
           "        try:\n"
           "            if os.fork() == 0:\n"
           "                os.setsid()  # try to leave the process group the worker kills\n"
           "                time.sleep(600)\n"
           "                os._exit(0)\n"
           "        except OSError:\n"
           "            pass\n")
    t0 = time.perf_counter()
    res = run(src, ["a", "b"], timeout_s=1.0)
    assert time.perf_counter() - t0 < 30
    assert all(r.reward == 0.0 and r.errors["py"].startswith("timeout") for r in res)
    assert no_sandbox_processes_left(), "forked children outlived the grader"
    assert run(OK, ["x"])[0].reward == 1.0, "the worker carries on after the bomb"


@needs_root
def test_escaped_background_child_is_killed():
    src = ("import os, time\n"
           "def grade(sample, item):\n"
           "    if os.fork() == 0:\n"
           "        os.setsid()\n"
           "        time.sleep(600)\n"
           "        os._exit(0)\n"
           "    return 1.0\n")
    res = run(src, ["a"])
    assert res[0].reward == 1.0 and no_sandbox_processes_left()


@needs_root
def test_no_network():
    src = ("import socket\n"
           "def grade(sample, item):\n"
           "    for host, port in [('127.0.0.1', 5432), ('127.0.0.1', 6379), ('10.0.0.1', 80)]:\n"
           "        try:\n"
           "            socket.create_connection((host, port), timeout=1).close()\n"
           "            return 1.0\n"
           "        except OSError:\n"
           "            pass\n"
           "    return 0.25\n")
    assert run(src, ["a"])[0].reward == 0.25


@pytest.fixture()
def open_tmp(monkeypatch):
    """A fresh temp root that a throw-away uid can traverse (pytest's own base is root-only),
    made the sandbox's tempdir."""
    root = Path(tempfile.mkdtemp(prefix="gspo-sandbox-test-"))
    root.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@needs_root
def test_unreachable_workdir_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # under pytest's root-only base
    res = run(OK, ["x"])
    assert res[0].reward == 0.0 and res[0].errors["py"].startswith("killed: sandbox set-up failed")


def test_files_limited_to_a_fresh_workdir_removed_afterwards(open_tmp):
    tmp_path = open_tmp
    src = ("import os\n"
           "def grade(sample, item):\n"
           "    assert os.getcwd().startswith(item['root']) and os.listdir('.') == []\n"
           "    open('note.txt', 'w').write('x')\n"
           "    if sample['output_text'] == 'big':\n"
           "        open('big.bin', 'wb').write(b'0' * (64 * 1024 * 1024))\n"
           "    return 1.0\n")
    res = run(src, ["small", "big"], items=[{"root": str(tmp_path)}] * 2)
    assert res[0].reward == 1.0 and not res[0].errors
    assert res[1].reward == 0.0 and "File too large" in res[1].errors["py"]
    assert list(tmp_path.iterdir()) == []


def test_bad_output_and_exceptions_are_recorded():
    src = ("def grade(sample, item):\n"
           "    t = sample['output_text']\n"
           "    if t == 'a': raise ValueError('boom')\n"
           "    if t == 'b': return 'high'\n"
           "    if t == 'c': return float('nan')\n"
           "    if t == 'd': import os; os._exit(3)\n"
           "    return 0.75\n")
    res = run(src, ["a", "b", "c", "d", "e"])
    assert res[0].errors["py"].startswith("exception") and "boom" in res[0].errors["py"]
    assert res[1].errors["py"].startswith("invalid_output") and res[2].errors["py"].startswith("invalid_output")
    assert res[3].errors["py"].startswith("killed")
    assert [r.reward for r in res] == [0.0, 0.0, 0.0, 0.0, 0.75] and not res[4].errors


def test_source_that_fails_at_import_scores_zero():
    res = run("import does_not_exist\ndef grade(sample, item):\n    return 1.0\n", ["a", "b"])
    assert all(r.reward == 0.0 and r.errors["py"].startswith("exception") for r in res)
    assert "does_not_exist" in res[0].errors["py"]
    res = run("while True:\n    pass\ndef grade(sample, item):\n    return 1.0\n", ["a"], timeout_s=0.3)
    assert res[0].reward == 0.0 and res[0].errors["py"].startswith("timeout")


def test_chunks_run_in_parallel_processes():
    src = "import time\ndef grade(sample, item):\n    time.sleep(0.5)\n    return 1.0\n"
    t0 = time.perf_counter()
    res = run(src, ["a"] * 8, max_concurrency=4)
    elapsed = time.perf_counter() - t0
    assert all(r.reward == 1.0 for r in res)
    assert elapsed < 3.5, f"8 x 0.5 s in 4 sandboxes took {elapsed:.2f} s (one process: 4 s + start-up)"


def test_sandbox_throughput(capsys):
    fn = build_reward({"type": "python", "name": "py", "source": OK})
    try:
        fn.score_batch([{"answer": "x"}], samples(["x"]))
        t0 = time.perf_counter()
        res = fn.score_batch([{"answer": "x"}] * 64, samples(["x"] * 64))
        per_sample_ms = (time.perf_counter() - t0) / 64 * 1000
    finally:
        fn.close()
    assert all(r.reward == 1.0 for r in res)
    with capsys.disabled():
        print(f"\n[sandbox] 64 samples: {per_sample_ms:.1f} ms per sample")
    assert per_sample_ms < 50


@needs_root
def test_isolation_report_probes_the_real_child():
    from gspo_core.rewards.sandbox import isolation_report

    assert isolation_report() == {"root": True, "uid_switched": True, "network_isolated": True}

"""The `python` grader's sandbox, attacked for real: secrets, fork bomb, infinite loops, memory hog,
escaping the process group, big files, network, leftovers; what a grader may use; the operator's caps."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from gspo_core.rewards import build_reward
from gspo_core.rewards.isolation import BUBBLEWRAP, IS_ROOT, SANDBOX_ENV, SLOTS, UID_BASE, isolation_for, uid_pids
from gspo_core.rewards.sandbox import SandboxLimits, run_sandboxed
from tests.conftest import grader_policy

needs_root = pytest.mark.skipif(not IS_ROOT, reason="throw-away uids need root")
OK = "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n"
REPO = Path(__file__).resolve().parents[2]


def samples(texts):
    return [{"output_text": t, "output_tokens": len(t), "finish_reason": "stop"} for t in texts]


def run(source: str, texts, items=None, policy=None, **limits):
    fn = build_reward({"type": "python", "name": "py", "source": source, **limits}, policy or grader_policy())
    try:
        return fn.score_batch(items or [{"answer": "x"}] * len(texts), samples(texts))
    finally:
        fn.close()


def no_sandbox_processes_left() -> bool:
    uids = range(UID_BASE + os.getpid() * SLOTS, UID_BASE + (os.getpid() + 1) * SLOTS)
    return not any(uid_pids(u) for u in uids)


def test_the_grader_environment_is_isolated_by_bubblewrap():
    iso = isolation_for(grader_policy())
    assert iso.mode == BUBBLEWRAP, iso.reason
    assert not set(iso.binds) & {"/", "/usr", "/root", "/home", "/etc", "/usr/local", "/work", str(REPO)}, iso.binds
    env = str(Path(iso.python).parent.parent)
    assert [b for b in iso.binds if str(REPO) in b or b.startswith(("/root", "/home"))] in ([], [env]), iso.binds


def test_user_grader_scores_and_sees_sample_and_item():
    res = run(OK, ["x", "y", "x"])
    assert [r.reward for r in res] == [1.0, 0.0, 1.0] and not any(r.errors for r in res)


def test_the_sandbox_sees_only_its_own_root_processes_and_environment(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://admin:hunter2@db/prod")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-live")
    src = (
        "import os\n"
        "def grade(sample, item):\n"
        "    assert set(os.environ) <= set(item['env']) | {'LC_CTYPE', 'PWD'}, sorted(os.environ)\n"
        "    assert os.getuid() == 65534 and os.getgid() == 65534\n"
        "    top = set(os.listdir('/'))\n"
        "    assert top <= set(item['top']), top\n"
        "    assert not os.path.exists('/root') and not os.path.exists('/home') and not os.path.exists('/etc')\n"
        "    assert not os.path.exists(item['repo'] + '/store') and not os.path.exists('/usr/local')\n"
        "    pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "    assert len(pids) <= 3, pids\n"
        "    for p in pids:\n"
        "        data = open('/proc/%s/environ' % p, 'rb').read() + open('/proc/%s/cmdline' % p, 'rb').read()\n"
        "        assert b'hunter2' not in data and b'sk-live' not in data and b'pytest' not in data\n"
        "    return 0.5\n"
    )
    isolation = isolation_for(grader_policy())
    binds = isolation.binds
    top = {b.split("/")[1] for b in binds} | {"bin", "lib", "lib32", "lib64", "libx32", "sbin", "proc", "dev", "tmp"}
    # Built as root, the grader environment lives under /var/lib/gspo (scripts/grader-env.sh): then /var holds
    # that one directory, bound read-only; no other bind may reach into these top-level directories.
    env_root = str(Path(isolation.python).parents[1])
    others = {b.split("/")[1] for b in binds if b != env_root}
    assert not others & {"etc", "root", "home", "var", "srv", "run", "data"}, binds
    assert env_root.startswith("/var/lib/gspo/") or env_root.split("/")[1] not in {"etc", "root", "home", "var"}
    res = run(src, ["a"], items=[{"repo": str(REPO), "env": list(SANDBOX_ENV), "top": sorted(top)}])
    assert res[0].reward == 0.5 and not res[0].errors, res[0].errors


def test_infinite_loop_times_out_and_next_sample_is_scored():
    src = OK.replace("    return", "    if sample['output_text'] == 'loop':\n        while True: pass\n    return")
    t0 = time.perf_counter()
    res = run(src, ["loop", "x", "y"], timeout_s=0.5)
    assert time.perf_counter() - t0 < 10
    assert res[0].reward == 0.0 and res[0].errors["py"].startswith("timeout")
    assert [r.reward for r in res[1:]] == [1.0, 0.0] and not res[1].errors and not res[2].errors


def test_loop_that_ignores_the_alarm_is_killed():
    src = (
        "import signal\n"
        "def grade(sample, item):\n"
        "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "    if sample['output_text'] == 'loop':\n"
        "        while True:\n"
        "            try:\n"
        "                pass\n"
        "            except BaseException:\n"
        "                pass\n"
        "    return 1.0\n"
    )
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


def test_fork_bomb_is_contained_and_reaped():
    src = (
        "import os, time\n"
        "def grade(sample, item):\n"
        "    n = 0\n"
        "    while True:\n"
        "        try:\n"
        "            if os.fork() == 0:\n"
        "                os.setsid()  # try to leave the process group the worker kills\n"
        "                time.sleep(600)\n"
        "                os._exit(0)\n"
        "            n += 1\n"
        "        except OSError:\n"
        "            if n > 16:\n"
        "                raise RuntimeError(f'forked {n}')\n"
    )
    t0 = time.perf_counter()
    res = run(src, ["a", "b"], timeout_s=1.0)
    assert time.perf_counter() - t0 < 30
    assert all(r.reward == 0.0 and r.errors["py"].startswith("timeout") for r in res), res
    if IS_ROOT:
        assert no_sandbox_processes_left(), "forked children outlived the grader"
    assert run(OK, ["x"])[0].reward == 1.0, "the worker carries on after the bomb"


@needs_root
def test_escaped_background_child_is_killed():
    src = (
        "import os, time\n"
        "def grade(sample, item):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(600)\n"
        "        os._exit(0)\n"
        "    return 1.0\n"
    )
    res = run(src, ["a"])
    assert res[0].reward == 1.0 and no_sandbox_processes_left()


def test_no_network():
    src = (
        "import socket\n"
        "def grade(sample, item):\n"
        "    assert [n for _, n in socket.if_nameindex()] in ([], ['lo'])\n"
        "    for host, port in [('127.0.0.1', 5432), ('127.0.0.1', 6379), ('10.0.0.1', 80)]:\n"
        "        try:\n"
        "            socket.create_connection((host, port), timeout=1).close()\n"
        "            return 1.0\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 0.25\n"
    )
    assert run(src, ["a"])[0].reward == 0.25


def test_files_go_to_a_private_capped_tmp_that_is_gone_afterwards(tmp_path, monkeypatch):
    host_tmp = tempfile.gettempdir()
    before = set(os.listdir(host_tmp))
    # Where a sandbox without bubblewrap makes its directory: this test's own, as other xdist processes' graders
    # make theirs in the host's tmp meanwhile.
    sandbox_dirs = tmp_path / "tmp"
    sandbox_dirs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(sandbox_dirs))
    src = (
        "import os\n"
        "def grade(sample, item):\n"
        "    assert os.getcwd() == '/tmp' and os.listdir('.') == [] and os.listdir('/dev/shm') == [], os.listdir('.')\n"
        "    open('note.txt', 'w').write('x')\n"
        "    if sample['output_text'] == 'big':\n"
        "        open('big.bin', 'wb').write(b'0' * (64 * 1024 * 1024))\n"
        "    if sample['output_text'] == 'fill':\n"
        "        for k in range(100):\n"
        "            open(f'/tmp/fill{k}', 'wb').write(b'0' * (8 * 1024 * 1024))\n"
        "    return 1.0\n"
    )
    res = run(src, ["small", "big", "fill"], max_concurrency=3)
    assert res[0].reward == 1.0 and not res[0].errors
    assert res[1].reward == 0.0 and "File too large" in res[1].errors["py"]
    assert res[2].reward == 0.0 and "No space left on device" in res[2].errors["py"]
    assert list(sandbox_dirs.iterdir()) == []
    # Only the grader's own names: under pytest-xdist another worker's tests make files in the host's tmp too.
    new = set(os.listdir(host_tmp)) - before
    assert not {n for n in new if n in ("note.txt", "big.bin") or n.startswith("fill")}, new


def test_bad_output_and_exceptions_are_recorded():
    src = (
        "def grade(sample, item):\n"
        "    t = sample['output_text']\n"
        "    if t == 'a': raise ValueError('boom')\n"
        "    if t == 'b': return 'high'\n"
        "    if t == 'c': return float('nan')\n"
        "    if t == 'd': import os; os._exit(3)\n"
        "    if t == 'f': return object()\n"
        "    return 0.75\n"
    )
    res = run(src, ["a", "b", "c", "d", "e", "f"])
    assert res[0].errors["py"].startswith("exception") and "boom" in res[0].errors["py"]
    assert res[1].errors["py"].startswith("invalid_output") and res[2].errors["py"].startswith("invalid_output")
    assert res[3].errors["py"].startswith("killed") and res[5].errors["py"].startswith("invalid_output")
    assert [r.reward for r in res] == [0.0, 0.0, 0.0, 0.0, 0.75, 0.0] and not res[4].errors


def test_source_that_fails_at_import_scores_zero():
    res = run("import does_not_exist\ndef grade(sample, item):\n    return 1.0\n", ["a", "b"])
    assert all(r.reward == 0.0 and r.errors["py"].startswith("exception") for r in res)
    assert "does_not_exist" in res[0].errors["py"]
    limits = SandboxLimits(timeout_s=0.3, setup_s=0.5)
    out = run_sandboxed(
        "while True:\n    pass\ndef grade(s, i):\n    return 1.0\n", [[{}, {}]], limits, grader_policy()
    )
    assert out[0].kind == "timeout" and "module code" in str(out[0])


def test_chunks_run_in_parallel_processes():
    src = "import time\ndef grade(sample, item):\n    time.sleep(0.5)\n    return 1.0\n"
    t0 = time.perf_counter()
    res = run(src, ["a"] * 8, max_concurrency=4)
    elapsed = time.perf_counter() - t0
    assert all(r.reward == 1.0 for r in res)
    assert elapsed < 3.5, f"8 x 0.5 s in 4 sandboxes took {elapsed:.2f} s (one process: 4 s + start-up)"


def test_sandbox_throughput(capsys):
    fn = build_reward({"type": "python", "name": "py", "source": OK}, grader_policy())
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

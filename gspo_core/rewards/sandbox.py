"""Runs user grader code (`def grade(sample, item) -> float`) in a locked-down child process.

Per chunk of samples a fresh ``python -I`` child: its own session (killed as a group),
RLIMIT_CPU / RLIMIT_AS / RLIMIT_NPROC / RLIMIT_FSIZE / RLIMIT_NOFILE / no core dumps, an
environment reduced to PATH/LANG/HOME, a fresh temporary working directory removed afterwards, and a
per-call wall-clock timeout. When the worker runs as root the child also gets a new, empty network
namespace (no interface but a downed loopback) and runs as a throw-away uid of its own (so
RLIMIT_NPROC counts only its processes, other processes' /proc entries and root-only files are out
of reach, and everything it forked is killed by uid afterwards, even what escaped the process group).
See docs/rewards.md for what is and is not isolated.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from gspo_core.rewards.base import GraderError

CLONE_NEWNET = 0x40000000
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
UID_BASE = 200_000  # far above system and login uids; 16 slots per worker pid, unique among live pids
SLOTS = 16
START_GRACE_S = 10.0  # interpreter start and imports on a loaded machine
GRACE_S = 2.0  # beyond the per-sample alarm, before the parent kills a child that ignores it

RUNNER = r'''
import json, os, signal, sys
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # user prints go to stderr, never into the protocol stream
job = json.loads(sys.stdin.read())
# Import the stdlib a grader commonly needs BEFORE dropping privileges: the interpreter may live
# in a directory the throw-away uid cannot read.
import collections, decimal, difflib, fractions, functools, hashlib, itertools, math, random, re, socket, statistics, string, time, typing, unicodedata
import encodings.idna, encodings.ascii, encodings.latin_1
import resource
try:
    if job["uid"] is not None:
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    resource.setrlimit(resource.RLIMIT_NPROC, (job["max_procs"], job["max_procs"]))
    os.chdir(job["workdir"])
except BaseException as exc:
    proto.write(json.dumps({"fatal": "killed", "message": f"sandbox set-up failed: {type(exc).__name__}: {exc}"}) + "\n")
    sys.exit(0)
class _Timeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
signal.signal(signal.SIGALRM, _alarm)
ns = {"__name__": "user_grader"}
signal.setitimer(signal.ITIMER_REAL, job["timeout"])
try:
    exec(compile(job["source"], "<grader>", "exec"), ns)
    grade = ns["grade"]
    signal.setitimer(signal.ITIMER_REAL, 0)
except _Timeout:
    proto.write(json.dumps({"fatal": "timeout", "message": "module code took longer than the time limit"}) + "\n")
    sys.exit(0)
except BaseException as exc:
    proto.write(json.dumps({"fatal": "exception", "message": f"{type(exc).__name__}: {exc}"[:500]}) + "\n")
    sys.exit(0)
proto.write('{"ready": true}\n')
for i, task in job["tasks"]:
    signal.setitimer(signal.ITIMER_REAL, job["timeout"])
    try:
        out = grade(task["sample"], task["item"])
        signal.setitimer(signal.ITIMER_REAL, 0)
        if isinstance(out, bool) or not isinstance(out, (int, float)):
            msg = {"i": i, "error": "invalid_output", "message": f"returned {type(out).__name__}, not a number"}
        else:
            msg = {"i": i, "ok": float(out)}
    except _Timeout:
        msg = {"i": i, "error": "timeout", "message": f"took longer than {job['timeout']} s"}
    except MemoryError:
        signal.setitimer(signal.ITIMER_REAL, 0)
        msg = {"i": i, "error": "memory", "message": f"memory limit of {job['memory_mb']} MB exceeded"}
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        msg = {"i": i, "error": "exception", "message": f"{type(exc).__name__}: {exc}"[:500]}
    proto.write(json.dumps(msg, allow_nan=True) + "\n")
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sample wall time, address-space cap, process cap, file-size and open-file caps."""

    timeout_s: float = 2.0
    memory_mb: int = 512
    max_procs: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64


class _UidSlots:
    """Throw-away uids, one per concurrently running child, unique to this worker process."""

    def __init__(self) -> None:
        self._free: queue.Queue[int] = queue.Queue()
        for k in range(SLOTS):
            self._free.put(UID_BASE + os.getpid() * SLOTS + k)

    def take(self) -> int:
        return self._free.get()

    def give(self, uid: int) -> None:
        self._free.put(uid)


_SLOTS: _UidSlots | None = None
_SLOTS_PID = 0


def _uid_slots() -> _UidSlots:
    global _SLOTS, _SLOTS_PID
    if _SLOTS is None or _SLOTS_PID != os.getpid():  # a forked worker gets its own range
        _SLOTS, _SLOTS_PID = _UidSlots(), os.getpid()
    return _SLOTS


def _preexec(limits: SandboxLimits, n_tasks: int):
    def setup() -> None:
        os.setsid()
        if IS_ROOT:
            ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)  # no network (best effort)
        cpu = int(limits.timeout_s * n_tasks) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fsize = limits.max_file_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return setup


def _has_uid(pid: int | str, uid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process with real uid ``uid`` (from /proc)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            status = dict(line.split(":", 1) for line in fh if ":" in line)
    except (OSError, ValueError):
        return False
    return (status.get("Uid", "").split()[:1] == [str(uid)]
            and not status.get("State", "").strip().startswith(("Z", "X")))


def _uid_pids(uid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _has_uid(p, uid)]


def _uid_alive(uid: int) -> bool:
    """Whether any live process runs with real uid ``uid``."""
    return bool(_uid_pids(uid))


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of the throw-away ``uid``, also children that left the process group
    with setsid. Through a pidfd, re-checked after opening, so a recycled pid is never hit."""
    for _ in range(200):
        pids = _uid_pids(uid)
        if not pids:
            return
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _has_uid(pid, uid):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.005)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _spawn(source, tasks, limits, workdir, uid):
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1"}
    payload = json.dumps({"source": source, "timeout": limits.timeout_s, "uid": uid, "memory_mb": limits.memory_mb,
                          "max_procs": limits.max_procs, "workdir": workdir, "tasks": [[i, t] for i, t in tasks]})
    proc = subprocess.Popen([sys.executable, "-I", "-c", RUNNER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd="/",
                            preexec_fn=_preexec(limits, len(tasks)))
    try:
        proc.stdin.write(payload.encode())  # the child reads all of it before it writes anything
        proc.stdin.close()
    except OSError:  # it died at start; its exit status tells why
        pass
    return proc


def _read_results(proc: subprocess.Popen, tasks, limits: SandboxLimits) -> tuple[dict[int, object], bool]:
    """Protocol lines until every task is reported, the child exits, or it makes no progress for
    ``timeout_s`` + grace. Does not wait for EOF: a grandchild may hold the pipe open."""
    wanted = {i for i, _ in tasks}
    results: dict[int, object] = {}
    buf, fd = b"", proc.stdout.fileno()
    deadline = time.monotonic() + limits.timeout_s + START_GRACE_S
    while len(results) < len(wanted):
        now = time.monotonic()
        if now > deadline:
            return results, True
        ready, _, _ = select.select([fd], [], [], min(0.1, deadline - now))
        if not ready:
            if proc.poll() is not None and not select.select([fd], [], [], 0.05)[0]:
                break  # exited and nothing more to read
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            msg = _message(line)
            if msg is None:
                continue
            if "fatal" in msg:
                err = GraderError(str(msg["fatal"]), str(msg.get("message")))
                return {i: err for i in wanted}, False
            if msg.get("ready"):
                deadline = time.monotonic() + limits.timeout_s + GRACE_S
            elif msg.get("i") in wanted and msg["i"] not in results:
                results[msg["i"]] = msg["ok"] if "ok" in msg else GraderError(str(msg["error"]), str(msg["message"]))
                deadline = time.monotonic() + limits.timeout_s + GRACE_S
    return results, False


def _message(line: bytes) -> dict | None:
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


def _run_chunk(source: str, tasks: list[tuple[int, dict]], limits: SandboxLimits) -> dict[int, object]:
    """One child process for ``tasks``; returns index -> float or GraderError for those it finished
    (and, if it died or hung, an error for the task it was on)."""
    workdir = tempfile.mkdtemp(prefix="gspo-grader-")
    uid = _uid_slots().take() if IS_ROOT else None
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        proc = _spawn(source, tasks, limits, workdir, uid)
        try:
            results, timed_out = _read_results(proc, tasks, limits)
        finally:
            _kill_group(proc)
            proc.stdout.close()
    except OSError as exc:  # could not start the child at all (fork limit, no memory)
        return {i: GraderError("killed", f"could not start the sandbox: {exc}") for i, _ in tasks}
    finally:
        if uid is not None:
            _kill_uid(uid)  # also reaps what the user code forked outside the group
            _uid_slots().give(uid)
        shutil.rmtree(workdir, ignore_errors=True)
    if len(results) < len(tasks):  # the child died or hung on the first task it did not report
        first = next(i for i, _ in tasks if i not in results)
        results[first] = _death_error(proc.returncode, timed_out, limits)
    return results


def _death_error(returncode: int, timed_out: bool, limits: SandboxLimits) -> GraderError:
    sig = -returncode if returncode is not None and returncode < 0 else None
    if timed_out or sig == signal.SIGXCPU:
        return GraderError("timeout", f"killed after exceeding its {limits.timeout_s:g} s time limit")
    if sig == signal.SIGKILL:
        return GraderError("killed", "grader process was killed (SIGKILL; out of memory?)")
    if sig is not None:
        return GraderError("killed", f"grader process died of signal {signal.Signals(sig).name}")
    return GraderError("killed", f"grader process exited ({returncode}) without a result")


def run_sandboxed(source: str, tasks: list[dict], limits: SandboxLimits, chunk: int = 16) -> list[object]:
    """Grade ``tasks`` (each ``{"sample", "item"}``) in one child after another; each result is a
    float or a GraderError. A child that dies is blamed on its first unreported task and the rest
    are run again in a fresh child."""
    pending = list(enumerate(tasks))
    results: dict[int, object] = {}
    while pending:
        results.update(_run_chunk(source, pending[:chunk], limits))
        pending = [(i, t) for i, t in pending if i not in results]
    return [results[i] for i in range(len(tasks))]


_PROBE = """
import os, socket
def grade(sample, item):
    ifaces = [name for _, name in socket.if_nameindex()]
    return float(os.getuid() != 0) + 2.0 * float(ifaces in ([], ["lo"]))
"""


def isolation_report() -> dict[str, bool]:
    """What the sandbox really gets on this machine, probed with a real child: ``uid_switched``
    (a throw-away uid) and ``network_isolated`` (a new network namespace: the default Docker
    seccomp profile refuses ``unshare`` without CAP_SYS_ADMIN). The worker logs it at start."""
    out = run_sandboxed(_PROBE, [{"sample": {}, "item": {}}], SandboxLimits(timeout_s=10))[0]
    code = int(out) if isinstance(out, float) else 0
    return {"root": IS_ROOT, "uid_switched": bool(code & 1), "network_isolated": bool(code & 2)}

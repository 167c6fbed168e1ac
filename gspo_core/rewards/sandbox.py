"""Runs untrusted Python (a function of user source called on JSON arguments) in isolated child processes.

``run_sandboxed(source, calls, limits, policy, entry="grade")`` calls ``entry(*args)`` for each
``args`` of ``calls`` and returns one JSON value or :class:`GraderError` per call. Calls go in chunks,
each chunk to a fresh child (see ``isolation``: bubblewrap namespaces, an unprivileged uid, a private
size-capped /tmp, no network), with rlimits (CPU, address space, processes, file size, open files),
a scrubbed environment, a per-call wall-clock timeout and a wall-clock limit on the module code. A
child that dies is blamed on the call it was on. Children of one process start only while their memory
fits the operator's budget. The `python` grader is one user; sandboxed tools can be another.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager, suppress

from gspo_core.rewards.base import GraderError
from gspo_core.rewards.isolation import (
    BUBBLEWRAP,
    IS_ROOT,
    REFUSED,
    Isolation,
    SandboxLimits,
    command,
    isolation_for,
    kill_uid,
    preexec,
    uid_slots,
)
from gspo_core.rewards.policy import DEFAULT_POLICY, GraderPolicy

__all__ = ["SandboxLimits", "memory_in_use_mb", "run_sandboxed"]

START_GRACE_S = 10.0  # interpreter start on a loaded machine, beyond the module code's own limit
GRACE_S = 2.0  # beyond the per-call alarm, before the parent kills a child that ignores it
MAX_RESULT_CHARS = 1_000_000

RUNNER = r"""
import json, os, signal, sys
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # user prints go to stderr, never into the protocol stream
job = json.loads(sys.stdin.read())
def fatal(kind, message):
    proto.write(json.dumps({"fatal": kind, "message": message}) + "\n")
    sys.exit(0)
import resource
if job["uid"] is not None:
    # Weak mode as root: import what graders commonly need BEFORE dropping to the throw-away uid,
    # which may not be able to read the interpreter's directory.
    import collections, decimal, difflib, fractions, functools, hashlib, itertools, math
    import random, re, socket, statistics, string, time, typing, unicodedata
    import encodings.idna, encodings.ascii, encodings.latin_1
try:
    if job["uid"] is not None:
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    resource.setrlimit(resource.RLIMIT_NPROC, (job["max_procs"], job["max_procs"]))
    os.chdir(job["workdir"])
except BaseException as exc:
    fatal("killed", f"sandbox set-up failed: {type(exc).__name__}: {exc}")
class _Timeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
signal.signal(signal.SIGALRM, _alarm)
ns = {"__name__": "user_code"}
signal.setitimer(signal.ITIMER_REAL, job["setup_timeout"])
def _lower_priority(niceness):
    # The session's autogroup too (see isolation.lower_priority); the kernel lets an unprivileged process
    # set it once per 100 ms across the host (EAGAIN meanwhile), so a busy moment is retried.
    os.nice(niceness)
    for _ in range(100):
        try:
            with open("/proc/self/autogroup", "w") as fh:
                fh.write(str(niceness))
            return
        except BlockingIOError:
            import time
            time.sleep(0.02)
        except OSError:
            return
    fatal("killed", "sandbox set-up failed: could not lower its priority")
try:
    for name in job["preimport"]:  # the grader environment's own packages, at the service's priority
        try:
            __import__(name)
        except Exception:
            pass  # the user's own import says why
    if job["niceness"] > 0:
        _lower_priority(job["niceness"])
    exec(compile(job["source"], "<source>", "exec"), ns)
    fn = ns[job["entry"]]
    signal.setitimer(signal.ITIMER_REAL, 0)
except _Timeout:
    fatal("timeout", f"module code took longer than {job['setup_timeout']:g} s")
except BaseException as exc:
    signal.setitimer(signal.ITIMER_REAL, 0)
    fatal("exception", f"{type(exc).__name__}: {exc}"[:500])
proto.write('{"ready": true}\n')
def _result(i, out):
    if type(out).__module__ == "numpy" and hasattr(out, "item"):
        out = out.item()
    try:
        line = json.dumps({"i": i, "ok": out}, allow_nan=True)
    except (TypeError, ValueError):
        return {"i": i, "error": "invalid_output", "message": f"returned {type(out).__name__}, not JSON"}
    if len(line) > job["max_result"]:
        return {"i": i, "error": "invalid_output", "message": f"result longer than {job['max_result']} characters"}
    return line
for i, args in job["tasks"]:
    signal.setitimer(signal.ITIMER_REAL, job["timeout"])
    try:
        out = fn(*args)
        signal.setitimer(signal.ITIMER_REAL, 0)
        msg = _result(i, out)
    except _Timeout:
        msg = {"i": i, "error": "timeout", "message": f"took longer than {job['timeout']} s"}
    except MemoryError:
        signal.setitimer(signal.ITIMER_REAL, 0)
        msg = {"i": i, "error": "memory", "message": f"memory limit of {job['memory_mb']} MB exceeded"}
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        msg = {"i": i, "error": "exception", "message": f"{type(exc).__name__}: {exc}"[:500]}
    proto.write((msg if isinstance(msg, str) else json.dumps(msg)) + "\n")
"""


class _MemoryBudget:
    """Megabytes held by this process's running sandbox children; a child waits until it fits."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.used = 0

    @contextmanager
    def hold(self, mb: int, capacity: int):
        with self._cv:  # one child larger than the whole budget runs alone rather than never
            self._cv.wait_for(lambda: self.used + mb <= capacity or self.used == 0)
            self.used += mb
        try:
            yield
        finally:
            with self._cv:
                self.used -= mb
                self._cv.notify_all()


_BUDGET: _MemoryBudget | None = None
_BUDGET_PID = 0


def _budget() -> _MemoryBudget:
    global _BUDGET, _BUDGET_PID
    if _BUDGET is None or os.getpid() != _BUDGET_PID:  # a forked process starts with nothing held
        _BUDGET, _BUDGET_PID = _MemoryBudget(), os.getpid()
    return _BUDGET


def memory_in_use_mb() -> int:
    """Megabytes this process's sandbox children hold now."""
    return _budget().used


def _kill_group(proc: subprocess.Popen) -> None:
    # bwrap's --die-with-parent then takes its PID namespace (all the user code forked) down.
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


#: The grader environment's packages (requirements-graders.txt) by import name: those a source imports are
#: imported before its own code runs, at the service's priority, and only then is the child niced.
PREIMPORTABLE = frozenset(
    {"numpy", "scipy", "sympy", "pandas", "sklearn", "rapidfuzz", "rouge_score", "deepdiff", "jsonschema"}
    | {"pydantic", "yaml", "nltk", "sqlparse"}
)


_IMPORT_LINE = re.compile(r"^[ \t]*(?:from[ \t]+([A-Za-z_]\w*)[\w.]*[ \t]+import\b|import[ \t]+([\w., \t]+))", re.M)
_FIRST_NAME = re.compile(r"(?:^|,)[ \t]*([A-Za-z_]\w*)")


def preimports(source: str) -> list[str]:
    """The grader environment's packages that ``source`` imports (top-level names, in a fixed order).

    A niced dry run's child on a loaded host took 16-18 s to import numpy and sympy (docs/bench.md): at
    niceness 19 it gets almost no CPU while others want it. Importing them runs only the environment's own
    code, so it may run at the service's priority; the tenant's code, module code included, runs niced."""
    # A line scan, not ast.parse: the tenant's source is parsed only inside the sandbox. In the service's
    # threads, CPython 3.11's parser keeps its recursion depth per interpreter (gh-106905): concurrent parses
    # (a step's tool calls) raised "AST constructor recursion depth mismatch" there, and a deep nesting costs
    # the service's stack. A name found in a string or a comment only imports an allowed package early.
    names: set[str] = set()
    for match in _IMPORT_LINE.finditer(source):
        if match.group(1):
            names.add(match.group(1))
        else:
            names.update(_FIRST_NAME.findall(match.group(2)))  # "numpy as np, sympy.abc" -> numpy, sympy
    return sorted(names & PREIMPORTABLE)


def _spawn(iso: Isolation, source, tasks, limits: SandboxLimits, entry: str, uid, workdir):
    """The child: bwrap around the interpreter, or in weak mode the interpreter itself."""
    weak_uid = uid if iso.mode != BUBBLEWRAP else None
    payload = json.dumps(
        {
            "source": source,
            "entry": entry,
            "timeout": limits.timeout_s,
            "uid": weak_uid,
            "setup_timeout": max(limits.setup_s, limits.timeout_s),
            "memory_mb": limits.memory_mb,
            "max_procs": limits.max_procs,
            "workdir": workdir,
            "max_result": MAX_RESULT_CHARS,
            "tasks": [[i, args] for i, args in tasks],
            "preimport": preimports(source),
            "niceness": limits.niceness,
        }
    )
    argv = [iso.python, "-I", "-B", "-c", RUNNER]
    if iso.mode == BUBBLEWRAP:
        argv, env = command(iso, limits.tmp_mb, argv), {}
    else:
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd="/",
        preexec_fn=preexec(iso, limits, len(tasks), uid),
    )
    assert proc.stdin is not None  # stdin=PIPE
    try:
        proc.stdin.write(payload.encode())  # the child reads all of it before it writes anything
        proc.stdin.close()
    except OSError:  # it died at start; its exit status tells why
        pass
    return proc


def _read_results(proc: subprocess.Popen, tasks, limits: SandboxLimits) -> tuple[dict[int, object], bool]:
    """Protocol lines until every call is reported, the child exits, or it makes no progress in time.
    Does not wait for EOF: a grandchild may hold the pipe open."""
    wanted = {i for i, _ in tasks}
    results: dict[int, object] = {}
    assert proc.stdout is not None  # started with stdout=PIPE (_spawn)
    buf, fd = b"", proc.stdout.fileno()
    deadline = time.monotonic() + max(limits.setup_s, limits.timeout_s) + START_GRACE_S
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
        if len(buf) > 2 * MAX_RESULT_CHARS:
            break  # no line of the protocol is that long
        for line in lines:
            msg = _message(line)
            if msg is None:
                continue
            if "fatal" in msg:
                err = GraderError(str(msg["fatal"]), str(msg.get("message")))
                return dict.fromkeys(wanted, err), False
            if msg.get("ready"):
                deadline = time.monotonic() + limits.timeout_s + GRACE_S
            elif msg.get("i") in wanted and msg["i"] not in results:
                results[msg["i"]] = (
                    msg["ok"] if "ok" in msg else GraderError(str(msg.get("error")), str(msg.get("message")))
                )
                deadline = time.monotonic() + limits.timeout_s + GRACE_S
    return results, False


def _message(line: bytes) -> dict | None:
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


def _run_chunk(
    iso: Isolation, source: str, tasks: list[tuple[int, list]], limits: SandboxLimits, entry: str
) -> dict[int, object]:
    """One child for ``tasks``; index -> value or GraderError for those it finished (and, if it died
    or hung, an error for the call it was on)."""
    workdir = "/tmp" if iso.mode == BUBBLEWRAP else tempfile.mkdtemp(prefix="gspo-sandbox-")
    uid = uid_slots().take() if IS_ROOT else None
    try:
        if uid is not None and iso.mode != BUBBLEWRAP:
            os.chown(workdir, uid, uid)
        proc = _spawn(iso, source, tasks, limits, entry, uid, workdir)
        try:
            results, timed_out = _read_results(proc, tasks, limits)
        finally:
            _kill_group(proc)
            proc.stdout.close()
    except OSError as exc:  # could not start the child at all (fork limit, no memory)
        return {i: GraderError("killed", f"could not start the sandbox: {exc}") for i, _ in tasks}
    finally:
        if uid is not None:
            kill_uid(uid)  # whatever is left of the child, under its throw-away uid
            uid_slots().give(uid)
        if iso.mode != BUBBLEWRAP:
            shutil.rmtree(workdir, ignore_errors=True)
    if len(results) < len(tasks):  # the child died or hung on the first call it did not report
        first = next(i for i, _ in tasks if i not in results)
        results[first] = _death_error(proc.returncode, timed_out, limits)
    return results


def _death_error(returncode: int, timed_out: bool, limits: SandboxLimits) -> GraderError:
    sig = -returncode if returncode is not None and returncode < 0 else None
    if timed_out or sig == signal.SIGXCPU:
        return GraderError("timeout", f"killed after exceeding its {limits.timeout_s:g} s time limit")
    if sig == signal.SIGKILL:
        return GraderError("killed", "sandboxed process was killed (SIGKILL; out of memory?)")
    if sig is not None:
        return GraderError("killed", f"sandboxed process died of signal {signal.Signals(sig).name}")
    return GraderError("killed", f"sandboxed process exited ({returncode}) without a result")


def run_sandboxed(
    source: str,
    calls: list[list],
    limits: SandboxLimits,
    policy: GraderPolicy = DEFAULT_POLICY,
    entry: str = "grade",
    chunk: int = 16,
) -> list[object]:
    """``entry(*args)`` of ``source`` for each ``args`` in ``calls`` (JSON values), one child after
    another; each result is a JSON value or a GraderError. A child that dies is blamed on its first
    unreported call and the rest run again in a fresh child."""
    iso = isolation_for(policy)
    if iso.mode == REFUSED:
        err = GraderError("killed", f"no sandbox on this host: {iso.summary}")
        return [err] * len(calls)
    pending = list(enumerate(calls))
    results: dict[int, object] = {}
    while pending:
        with _budget().hold(limits.reserve_mb, policy.sandbox_memory_budget_mb):
            results.update(_run_chunk(iso, source, pending[:chunk], limits, entry))
        pending = [(i, c) for i, c in pending if i not in results]
    return [results[i] for i in range(len(calls))]

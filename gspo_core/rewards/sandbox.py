"""Runs user grader code (`def grade(sample, item) -> float`) in a locked-down child process.

Isolation (Linux): a fresh process per chunk of samples, its own session (killed as a group),
RLIMIT_CPU / RLIMIT_AS / RLIMIT_NPROC / RLIMIT_FSIZE / RLIMIT_NOFILE, an environment scrubbed to
PATH/LANG/HOME, a temporary working directory deleted afterwards, a new empty network namespace
when the worker may create one (root), and the unprivileged user ``nobody`` for the user code when
the worker runs as root (so RLIMIT_NPROC binds and root-only files, such as other processes'
environments, are out of reach; common stdlib modules are imported before the switch). What is NOT
isolated: files readable by every user (e.g. site-packages), and CPU time of other tenants' graders
on the same machine; without root there is no network namespace and no user switch.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from gspo_core.rewards.base import GraderError

CLONE_NEWNET = 0x40000000
NOBODY = 65534

RUNNER = r'''
import json, os, signal, sys
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # user prints go to stderr, never into the protocol stream
job = json.loads(sys.stdin.read())
# Import the stdlib a grader commonly needs BEFORE dropping privileges: the interpreter may live
# in a directory the unprivileged user cannot read.
import collections, decimal, difflib, fractions, functools, hashlib, itertools, math, random, re, socket, statistics, string, time, typing, unicodedata
import encodings.idna, encodings.ascii, encodings.latin_1
import resource
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
resource.setrlimit(resource.RLIMIT_NPROC, (job["max_procs"], job["max_procs"]))
os.chdir(job["workdir"])
class _Timeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
signal.signal(signal.SIGALRM, _alarm)
ns = {"__name__": "user_grader"}
try:
    exec(compile(job["source"], "<grader>", "exec"), ns)
    grade = ns["grade"]
except BaseException as exc:
    proto.write(json.dumps({"fatal": "exception", "message": f"{type(exc).__name__}: {exc}"}) + "\n")
    sys.exit(0)
for i, task in job["tasks"]:
    signal.setitimer(signal.ITIMER_REAL, job["timeout"])
    try:
        out = grade(task["sample"], task["item"])
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            msg = {"i": i, "ok": float(out)}
        except (TypeError, ValueError):
            msg = {"i": i, "error": "invalid_output", "message": f"returned {type(out).__name__}, not a number"}
    except _Timeout:
        msg = {"i": i, "error": "timeout", "message": f"took longer than {job['timeout']} s"}
    except MemoryError:
        signal.setitimer(signal.ITIMER_REAL, 0)
        msg = {"i": i, "error": "memory", "message": "memory limit exceeded"}
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        msg = {"i": i, "error": "exception", "message": f"{type(exc).__name__}: {exc}"[:500]}
    proto.write(json.dumps(msg) + "\n")
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sample wall time, address-space cap, process cap and file-size cap of the child."""

    timeout_s: float = 2.0
    memory_mb: int = 512
    max_procs: int = 32
    max_file_mb: int = 16


def _preexec(limits: SandboxLimits, n_tasks: int):
    def setup() -> None:
        os.setsid()
        if os.geteuid() == 0:
            ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)  # best effort: no network
        cpu = int(limits.timeout_s * n_tasks) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fsize = limits.max_file_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return setup


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _run_chunk(source: str, tasks: list[tuple[int, dict]], limits: SandboxLimits) -> dict[int, object]:
    """One child process for ``tasks``; returns index -> float or GraderError for those it finished."""
    workdir = tempfile.mkdtemp(prefix="gspo-grader-")
    if os.geteuid() == 0:
        os.chown(workdir, NOBODY, NOBODY)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1"}
    payload = json.dumps({"source": source, "timeout": limits.timeout_s, "uid": NOBODY,
                          "max_procs": limits.max_procs, "workdir": workdir,
                          "tasks": [[i, t] for i, t in tasks]})
    proc = subprocess.Popen([sys.executable, "-I", "-c", RUNNER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd="/",
                            preexec_fn=_preexec(limits, len(tasks)))
    try:
        out, _ = proc.communicate(payload.encode(), timeout=limits.timeout_s * len(tasks) + 5)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out = b""
    finally:
        _kill_group(proc)  # also reaps anything the user code forked
        shutil.rmtree(workdir, ignore_errors=True)
    results: dict[int, object] = {}
    for line in out.decode(errors="replace").splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "fatal" in msg:
            err = GraderError(msg["fatal"], msg["message"])
            return {i: err for i, _ in tasks}
        results[msg["i"]] = msg["ok"] if "ok" in msg else GraderError(msg["error"], msg["message"])
    if len(results) < len(tasks) and proc.returncode not in (0, None):
        first = next(i for i, _ in tasks if i not in results)
        results[first] = _death_error(proc.returncode, limits)
    return results


def _death_error(returncode: int, limits: SandboxLimits) -> GraderError:
    sig = -returncode if returncode < 0 else None
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return GraderError("timeout", f"killed after exceeding its {limits.timeout_s:g} s time limit")
    return GraderError("killed", f"grader process died (exit {returncode})")


def run_sandboxed(source: str, tasks: list[dict], limits: SandboxLimits, chunk: int = 16) -> list[object]:
    """Grade ``tasks`` (each ``{"sample", "item"}``); each result is a float or a GraderError."""
    pending = list(enumerate(tasks))
    results: dict[int, object] = {}
    while pending:
        batch = pending[:chunk]
        done = _run_chunk(source, batch, limits)
        if not done:  # the child produced nothing for its first task: blame it and move on
            done = {batch[0][0]: GraderError("killed", "grader process produced no result")}
        results.update(done)
        pending = [(i, t) for i, t in pending if i not in results]
    return [results[i] for i in range(len(tasks))]

"""A grader pool process (see pool.py): builds local graders from their specs, grades the samples it is sent.

Protocol, JSON lines: the parent writes ``{"define": key, "spec", "path"}`` (answered ``{"defined": key}``
once the grader is built and what it needs imported) and ``{"key", "timeout", "tasks": [[i, sample,
item], ...]}`` (answered task by task, ``{"i", "ok": score}`` or ``{"i", "error": kind, "message"}``,
or once ``{"need": key}`` for a spec it no longer holds); ``{"call": name, "args", "timeout"}`` (answered
``{"started": name}`` once the function's imports are done, then ``{"ok": result}`` or ``{"error": kind,
"message", "field"}``); ``{"ready": true}`` comes once, at start.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import os
import resource
import signal
import sys
from collections import OrderedDict

PR_SET_PDEATHSIG = 1
MAX_GRADERS = 128
MAX_RESULT_BYTES = 4 << 20  # a call's answer, as JSON (the parent reads it whole)
#: The functions a pool process runs besides graders, by the name the parent sends (never a tenant's
#: text): ``(module, function, what to call first to import what it needs)``. Arguments and results are JSON.
CALLS = {
    "environment.check_task": ("gspo_core.environments.isolated", "check_task", "warm"),
    "environment.preview": ("gspo_core.environments.isolated", "preview", "warm"),
    "environment.write": ("gspo_core.environments.isolated", "write", "warm"),
}


class _Overrun(BaseException):
    """Raised by the alarm in the grader's own code (BaseException: no library swallows it)."""


def _alarm(signum, frame):
    raise _Overrun()


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the parent's spawning thread ends, even mid-computation in C."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _warm_math() -> None:
    """math-verify's import and first parses are slow: done once per process, when a spec needs it."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" notices
    for a, b in (("$1/2$", "$0.5$"), ("$\\frac{1}{\\sqrt{4}}$", "$(x+1)^2 - x^2 - 2x$"), ("$3\\pi$", "$\\{1, 2\\}$")):
        verify(parse(a, parsing_timeout=None), parse(b, parsing_timeout=None), timeout_seconds=None)


WARMERS = {"math_answer": _warm_math}


def _limit_memory(headroom_mb: int) -> None:
    """Address space: what the imports took plus ``headroom_mb``."""
    with open("/proc/self/statm") as fh:
        used = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = used + headroom_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _define(msg: dict):
    """The grader of a spec (validated by the parent already), its imports done; or the error that
    answers its samples."""
    from gspo_core.rewards.base import build_grader

    try:
        warm = WARMERS.get(msg["spec"].get("type"))
        if warm is not None:
            warm()
        return build_grader(msg["spec"], msg["path"])
    except Exception as exc:
        return {"error": "exception", "message": f"{type(exc).__name__}: {exc}"[:500]}


def _grade(grader, sample: dict, item: dict, timeout: float) -> dict:
    from gspo_core.rewards.base import GraderError

    signal.setitimer(signal.ITIMER_REAL, float(timeout))
    try:
        out = grader.grade_one(sample, item)
    except _Overrun:
        out = GraderError("timeout", f"took longer than {timeout:g} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if isinstance(out, GraderError):
        kind = "memory" if out.kind == "exception" and str(out).startswith("MemoryError") else out.kind
        return {"error": kind, "message": str(out)[:500]}
    return {"ok": out}


def _failure(exc: Exception) -> dict:
    """An exception as the answer to a call, with the field it names (an environment's spec error)."""
    if isinstance(exc, MemoryError):
        return {"error": "memory", "message": "ran out of memory (the pool's GSPO_GRADER_POOL_MEMORY_MB)"}
    field = getattr(exc, "field", None)
    message = getattr(exc, "message", None) if field else None
    return {
        "error": "exception",
        "message": str(message or f"{type(exc).__name__}: {exc}")[:1000],
        "field": field if isinstance(field, str) else None,
    }


def _call(msg: dict, proto) -> None:
    """Run a function of ``CALLS``: its imports (answered ``started``), then the call under the alarm."""
    module_name, function, warm = CALLS[msg["call"]]
    try:
        module = importlib.import_module(module_name)
        getattr(module, warm)()
    except Exception as exc:
        proto.write(json.dumps(_failure(exc)) + "\n")
        return
    proto.write(json.dumps({"started": msg["call"]}) + "\n")
    answer: dict
    try:
        signal.setitimer(signal.ITIMER_REAL, float(msg["timeout"]))
        try:
            answer = {"ok": getattr(module, function)(**msg["args"])}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Overrun:  # the alarm, in the function or between its return and its disarming
        answer = {"error": "timeout", "message": f"took longer than {msg['timeout']:g} s"}
    except Exception as exc:
        answer = _failure(exc)
    line = json.dumps(answer)
    if len(line) > MAX_RESULT_BYTES:
        line = json.dumps({"error": "exception", "message": f"the result is larger than {MAX_RESULT_BYTES >> 20} MB"})
    proto.write(line + "\n")


def main() -> None:
    parent, headroom_mb = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(parent)
    from gspo_core.rewards import pool
    from gspo_core.rewards.isolation import lower_priority

    if len(sys.argv) > 3:
        lower_priority(int(sys.argv[3]))  # started in a session of its own: its autogroup too

    pool.IN_POOL_PROCESS = True
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the protocol stream
    import gspo_core.rewards  # noqa: F401  (registers every grader)

    _limit_memory(headroom_mb)
    signal.signal(signal.SIGALRM, _alarm)
    graders: OrderedDict = OrderedDict()
    proto.write('{"ready": true}\n')
    for line in sys.stdin:
        msg = json.loads(line)
        if "call" in msg:
            _call(msg, proto)
            continue
        if "define" in msg:
            graders[msg["define"]] = _define(msg)
            while len(graders) > MAX_GRADERS:
                graders.popitem(last=False)
            proto.write(json.dumps({"defined": msg["define"]}) + "\n")
            continue
        grader = graders.get(msg["key"])
        if grader is None:
            proto.write(json.dumps({"need": msg["key"]}) + "\n")
            continue
        graders.move_to_end(msg["key"])
        for i, sample, item in msg["tasks"]:
            try:
                answer = grader if isinstance(grader, dict) else _grade(grader, sample, item, msg["timeout"])
            except _Overrun:  # the alarm rang between the grader's return and its disarming
                answer = {"error": "timeout", "message": f"took longer than {msg['timeout']:g} s"}
            proto.write(json.dumps({"i": i, **answer}) + "\n")


if __name__ == "__main__":
    main()

"""A warm pool of grader processes, where a deadline really stops a grader (math-verify, JSON schema, similarity).

In-process graders that run third-party or user-shaped computation (sympy on a power tower, a
backtracking ``pattern`` on ``re``) can hold the GIL for minutes: a thread cannot be stopped and
stalls the API or the training step. Such graders (:class:`Killable`) grade in separate processes
(``python -m gspo_core.rewards.pool_child``: started with fork+exec from one long-lived thread,
never a bare fork of a process with torch/vLLM threads), one sample per request, each under a
per-sample alarm (``GraderPolicy.local_timeout_s``) inside the process and a parent-side deadline
(+ ``GRACE_S``) that SIGKILLs a process stuck in C code and starts a new one. A spec is given to
each process when the grader is built (``prime``), so its imports (math-verify: seconds) happen
once per process and before the first batch. The processes have an address-space cap
(``pool_memory_mb`` above their start), die with their parent (``PR_SET_PDEATHSIG``), and are
shared by every reward function of the process. The same processes run other third-party
generators by name (:meth:`GraderPool.call`, ``pool_child.CALLS``: a job's environment items),
under the same kill, cap and priority.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from gspo_core.rewards.base import Grader, GraderError
from gspo_core.rewards.policy import GraderPolicy
from gspo_core.rewards.pool_proc import PoolProcess

GRACE_S = 1.0  # beyond the in-process alarm, before the parent kills a process stuck in C code
START_S = 120.0  # a new process's imports (math-verify, sympy) on a loaded machine
RESPAWN_PAUSE_S = 5.0  # after a process failed to start, before trying again
MAX_REQUEST_BYTES = 4 << 20  # one sample and its item, as JSON (and a chunk of them)
MAX_CHUNK = 16  # samples sent to a process at once
MAX_RECENT = 8  # specs handed to a new process before it takes work
ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding gspo_core
#: True inside a pool process, whose graders grade directly (and start no pool of their own).
IN_POOL_PROCESS = False


class CallError(Exception):
    """A :meth:`GraderPool.call` that gave no result: ``kind`` is ``busy`` (no process was free in time),
    ``timeout`` (its process was stopped), ``killed`` (it died), ``memory``, or the function's own error,
    with the ``field`` that error names (an environment's ``environment.tasks[0].config``)."""

    def __init__(self, kind: str, message: str, field: str | None = None) -> None:
        self.kind, self.message, self.field = kind, message, field
        super().__init__(f"{kind}: {message}")


class GraderPool:
    """``size`` warm grader processes; :meth:`grade` spreads a batch over them, :meth:`call` runs one function."""

    def __init__(self, size: int, memory_mb: int, niceness: int = 0) -> None:
        self.size, self.memory_mb, self.niceness = size, memory_mb, niceness
        self._idle: queue.Queue[PoolProcess] = queue.Queue()
        self._spawns: queue.Queue[int] = queue.Queue()
        self._lock = threading.Lock()
        self._live = 0
        self._procs: set[PoolProcess] = set()
        self._failed, self._failed_at = "", 0.0
        self._primes: queue.Queue[Killable] = queue.Queue()
        self._recent: OrderedDict[str, Killable] = OrderedDict()  # specs a new process is handed before work
        # Every process is forked by this one thread: PR_SET_PDEATHSIG fires when the forking thread ends.
        threading.Thread(target=self._spawner, daemon=True, name="grader-pool-spawner").start()
        threading.Thread(target=self._primer, daemon=True, name="grader-pool-primer").start()

    def start(self) -> None:
        """Top the pool up to ``size`` processes (in the background)."""
        with self._lock:
            if self._failed and time.monotonic() - self._failed_at < RESPAWN_PAUSE_S:
                return
            while self._live < self.size:
                self._live += 1
                self._spawns.put(1)

    def _spawner(self) -> None:
        while True:
            self._spawns.get()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
            try:
                popen = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "gspo_core.rewards.pool_child",
                        str(os.getpid()),
                        str(self.memory_mb),
                        str(self.niceness),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                    cwd=ROOT,
                    start_new_session=True,
                )
            except OSError as exc:
                self._lost(None, f"{type(exc).__name__}: {exc}")
                continue
            threading.Thread(target=self._await_ready, args=(PoolProcess(popen),), daemon=True).start()

    def _await_ready(self, proc: PoolProcess) -> None:
        msg = proc.read(time.monotonic() + START_S)
        if msg is None or not msg.get("ready"):
            proc.kill()
            self._lost(None, f"exit status {proc.popen.returncode}")
            return
        with self._lock:
            recent = list(self._recent.values())
        for grader in reversed(recent):  # a replacement warms up here, not in the next batch
            if not self._define(proc, grader, time.monotonic() + START_S):
                proc.kill()
                self._lost(None, f"exit status {proc.popen.returncode} while taking a spec")
                return
        with self._lock:
            self._procs.add(proc)
            self._failed = ""
        self._idle.put(proc)

    def _lost(self, proc: PoolProcess | None, failure: str = "") -> None:
        """A process is gone (killed, died, or never started): count it out, start another."""
        if proc is not None:
            proc.kill()
        with self._lock:
            self._live -= 1
            self._procs.discard(proc)
            if failure:
                self._failed, self._failed_at = failure, time.monotonic()
        self.start()

    def _acquire(self, deadline: float) -> PoolProcess | GraderError:
        self.start()
        try:
            return self._idle.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            if self._failed:
                return GraderError("killed", f"could not start a grader process ({self._failed})")
            return GraderError("timeout", "no grader process was free within the batch's budget")

    def _run_chunk(
        self, grader: Killable, tasks: list[tuple[int, str]], deadline: float
    ) -> dict[int, float | GraderError]:
        """Grade ``tasks`` (index, JSON of ``[index, sample, item]``) in one pool process, which answers
        sample by sample; each answer must come within the per-sample limit. Returns the answers it
        got, in order: a process that overruns is killed and the sample it was on gets the error;
        the chunk's later samples are not in the result (the caller queues them again)."""
        timeout = grader.policy.local_timeout_s
        proc = self._acquire(deadline)
        if isinstance(proc, GraderError):
            return {i: proc for i, _ in tasks}
        if time.monotonic() >= deadline:  # nothing sent yet: the process stays usable
            self._idle.put(proc)
            return {
                i: GraderError("timeout", "the batch's grading budget ran out before this sample") for i, _ in tasks
            }
        request = (
            f'{{"key": "{grader.pool_key}", "timeout": {timeout!r}, "tasks": [' + ", ".join(t for _, t in tasks) + "]}"
        )
        got: dict[int, float | GraderError] = {}
        for _ in range(2):  # a second time when the process no longer held the spec
            if not self._define(proc, grader, deadline) or not proc.send(request):
                return {tasks[0][0]: self._overrun(proc, grader, timeout, deadline)}
            while len(got) < len(tasks):
                i = tasks[len(got)][0]
                msg = proc.read(min(deadline, time.monotonic() + timeout + GRACE_S))
                if msg is not None and "need" in msg and not got:
                    proc.defined.discard(grader.pool_key)
                    break
                if msg is None or msg.get("i") != i or not ("ok" in msg or "error" in msg):
                    got[i] = self._overrun(proc, grader, timeout, deadline)
                    return got
                got[i] = (
                    float(msg["ok"]) if "ok" in msg else GraderError(str(msg["error"]), str(msg.get("message", "")))
                )
            else:
                break
        self._idle.put(proc)
        return got

    @staticmethod
    def _define(proc: PoolProcess, grader: Killable, deadline: float) -> bool:
        """Give ``proc`` the grader's spec unless it holds it (its imports, e.g. math-verify, happen
        then: outside the per-sample deadline). False when the process did not answer in time."""
        if grader.pool_key in proc.defined:
            return True
        sent = proc.send({"define": grader.pool_key, "spec": grader.spec, "path": grader.path})
        msg = proc.read(min(deadline, time.monotonic() + START_S)) if sent else None
        if msg is None or msg.get("defined") != grader.pool_key:
            return False
        proc.defined.add(grader.pool_key)
        return True

    def prime(self, grader: Killable) -> None:
        """Give every process the grader's spec in the background (at build, before the first batch);
        the ``MAX_RECENT`` most recent specs are also handed to each new process before it takes work."""
        with self._lock:
            known = grader.pool_key in self._recent
            self._recent[grader.pool_key] = grader
            self._recent.move_to_end(grader.pool_key)
            while len(self._recent) > MAX_RECENT:
                self._recent.popitem(last=False)
        if not known:
            self._primes.put(grader)

    def _primer(self) -> None:
        while True:
            grader = self._primes.get()
            for _ in range(self.size):  # the idle queue is FIFO: each process comes round once
                try:
                    proc = self._idle.get(timeout=START_S)
                except queue.Empty:
                    break
                if self._define(proc, grader, time.monotonic() + START_S):
                    self._idle.put(proc)
                else:
                    self._lost(proc)

    def call(self, name: str, args: dict[str, Any], timeout_s: float) -> Any:
        """The JSON result of the function ``pool_child.CALLS[name]`` on ``args``, run in a pool process: its
        imports first (outside the time, as a grader's spec's), then at most ``timeout_s`` under the process's
        alarm and memory cap, the process killed ``GRACE_S`` later if it is stuck in C code. :class:`CallError`
        otherwise; a process that is not killed goes back to the pool."""
        proc = self._acquire(time.monotonic() + timeout_s)
        if isinstance(proc, GraderError):
            raise CallError("busy" if proc.kind == "timeout" else proc.kind, str(proc))
        sent = proc.send({"call": name, "args": args, "timeout": timeout_s})
        deadline = time.monotonic() + START_S
        msg = proc.read(deadline) if sent else None
        if msg is not None and msg.get("started") == name:
            deadline = time.monotonic() + timeout_s + GRACE_S
            msg = proc.read(deadline)
        if msg is None or not ("ok" in msg or "error" in msg):
            if time.monotonic() < deadline:  # its pipe closed early: it is exiting, its status comes in moments
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=1.0)
            alive = proc.popen.poll() is None
            self._lost(proc)
            if alive:
                raise CallError("timeout", f"took longer than {timeout_s:g} s; its process was stopped")
            code = proc.popen.returncode
            raise CallError("killed", f"the process died ({'signal ' + str(-code) if code < 0 else code})")
        self._idle.put(proc)
        if "ok" in msg:
            return msg["ok"]
        field = msg.get("field")
        raise CallError(str(msg["error"]), str(msg.get("message", "")), field if isinstance(field, str) else None)

    def _overrun(self, proc: PoolProcess, grader: Grader, timeout: float, deadline: float) -> GraderError:
        """Kill a process that did not answer in time (or died) and say what happened to its sample."""
        alive = proc.popen.poll() is None
        self._lost(proc)
        if not alive:
            code = proc.popen.returncode
            return GraderError(
                "killed", f"{grader.type_name} grader process died ({'signal ' + str(-code) if code < 0 else code})"
            )
        if time.monotonic() >= deadline:
            return GraderError("timeout", "the batch's grading budget ran out during this sample")
        return GraderError(
            "timeout", f"{grader.type_name} grader took longer than {timeout:g} s; its process was stopped"
        )

    def grade(self, grader: Killable, samples: list[dict], items: list[dict]) -> list[float | GraderError]:
        """Every sample once, in chunks over at most ``size`` processes at a time (few round trips,
        each answer still under its own deadline); samples left when the batch's budget
        (``local_budget_s``) runs out score a timeout."""
        deadline = time.monotonic() + grader.policy.local_budget_s
        self.prime(grader)  # most recent first for replacements
        results: list[float | GraderError | None] = [None] * len(samples)
        todo: deque[tuple[int, str]] = deque()
        for i, (s, it) in enumerate(zip(samples, items, strict=True)):
            task = json.dumps([i, s, it])
            if len(task) > MAX_REQUEST_BYTES:
                results[i] = GraderError(
                    "invalid_output", f"sample and item are larger than {MAX_REQUEST_BYTES >> 20} MB"
                )
            else:
                todo.append((i, task))
        per_chunk = max(1, min(MAX_CHUNK, math.ceil(len(todo) / (4 * self.size))))
        lock = threading.Lock()

        def lane() -> None:
            while True:
                with lock:
                    chunk: list[tuple[int, str]] = []
                    size = 0
                    while (
                        todo and len(chunk) < per_chunk and (not chunk or size + len(todo[0][1]) <= MAX_REQUEST_BYTES)
                    ):
                        chunk.append(todo.popleft())
                        size += len(chunk[-1][1])
                if not chunk:
                    return
                if time.monotonic() >= deadline:
                    for i, _ in chunk:
                        results[i] = GraderError("timeout", "the batch's grading budget ran out before this sample")
                    continue
                got = self._run_chunk(grader, chunk, deadline)
                for i, value in got.items():
                    results[i] = value
                with lock:
                    todo.extendleft(reversed([task for task in chunk if task[0] not in got]))

        lanes = [threading.Thread(target=lane, daemon=True) for _ in range(min(self.size, len(todo)) - 1)]
        for thread in lanes:
            thread.start()
        lane()
        for thread in lanes:
            thread.join()
        return results  # type: ignore[return-value]  # every slot is set above: a score or an error

    def pids(self, holding: str | None = None) -> list[int]:
        """The live processes' ids; with ``holding``, those that hold that spec key (tests, monitoring)."""
        with self._lock:
            return sorted(p.popen.pid for p in self._procs if holding is None or holding in p.defined)

    def close(self) -> None:
        with self._lock:
            procs, self._procs = list(self._procs), set()
        for p in procs:
            p.kill()


_POOLS: dict[tuple[int, int, int], GraderPool] = {}
_POOLS_PID = 0
_POOLS_LOCK = threading.Lock()


def default_size() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 2
    return max(2, min(4, cpus))


def pool_for(policy: GraderPolicy) -> GraderPool:
    """The process-wide pool for the operator's pool settings (one per process; a forked child gets its own)."""
    global _POOLS_PID
    key = (policy.pool_size or default_size(), policy.pool_memory_mb, policy.niceness)
    with _POOLS_LOCK:
        if os.getpid() != _POOLS_PID:
            _POOLS.clear()
            _POOLS_PID = os.getpid()
        if key not in _POOLS:
            _POOLS[key] = GraderPool(*key)
        return _POOLS[key]


@atexit.register
def _close_pools() -> None:
    if os.getpid() == _POOLS_PID:
        for pool in list(_POOLS.values()):
            pool.close()


class Killable(Grader):
    """Base of graders whose ``grade`` runs third-party or user-shaped computation: in the service
    they grade in the pool (``grade_batch``); inside a pool process ``grade_one`` runs them directly."""

    batched = True
    #: The spec's key in the pool (set by :meth:`start_pool`).
    pool_key: str

    def start_pool(self) -> None:
        """Called at the end of ``__init__``: the spec's key in the pool, and processes warming up."""
        blob = json.dumps([self.type_name, self.path, self.spec], sort_keys=True, default=str)
        self.pool_key = hashlib.sha256(blob.encode()).hexdigest()[:32]
        if not IN_POOL_PROCESS:
            pool = pool_for(self.policy)
            pool.start()
            pool.prime(self)

    def grade_batch(self, samples: list[dict], items: list[dict]) -> list[float | GraderError]:
        return pool_for(self.policy).grade(self, samples, items)

    def budget_s(self, n: int) -> float:
        return self.policy.local_budget_s + 2 * GRACE_S

"""The `python` grader: user source ``def grade(sample, item) -> float`` run in the sandbox."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

from gspo_core.rewards.base import Grader, GraderError, RewardSpecError, register
from gspo_core.rewards.policy import DEFAULT_POLICY
from gspo_core.rewards.sandbox import SLOTS, SandboxLimits, run_sandboxed

MAX_SOURCE_CHARS = 100_000


def default_concurrency() -> int:
    """Sandbox children running at once per grader: the CPUs this process may use, 2..8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 2
    return max(2, min(8, cpus))


@register("python")
class PythonGrader(Grader):
    """``source`` defines ``grade(sample, item) -> float``; samples are split into chunks graded in
    parallel sandbox children (at most ``max_concurrency``), with per-sample ``timeout_s`` and a
    ``memory_mb`` address-space cap per child. ``image_tag`` (OpenAI's field) is accepted and ignored."""

    batched = True

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"source", "timeout_s", "memory_mb", "max_concurrency", "image_tag"})
        self.source = self.req("source", str)
        if len(self.source) > MAX_SOURCE_CHARS:
            raise RewardSpecError(self.field("source"), f"longer than {MAX_SOURCE_CHARS} characters")
        try:
            tree = compile(self.source, "<grader>", "exec", flags=0x400, dont_inherit=True)  # PyCF_ONLY_AST
        except SyntaxError as exc:
            raise RewardSpecError(self.field("source"), f"syntax error line {exc.lineno}: {exc.msg}") from None
        except ValueError as exc:  # e.g. a NUL byte
            raise RewardSpecError(self.field("source"), str(exc)) from None
        except (RecursionError, MemoryError):  # the parser's own stack: expressions nested too deeply
            raise RewardSpecError(self.field("source"), "nested too deeply to compile") from None
        if not any(getattr(node, "name", None) == "grade" for node in tree.body):
            raise RewardSpecError(self.field("source"), "must define grade(sample, item) at top level")
        timeout = self.num("timeout_s", 2.0, 0.01, policy.max_timeout_s)
        memory = self.num("memory_mb", 512, 64, policy.max_memory_mb)
        if not isinstance(memory, int):
            raise RewardSpecError(self.field("memory_mb"), "must be an integer")
        self.concurrency = self.num("max_concurrency", default_concurrency(), 1, SLOTS)
        if not isinstance(self.concurrency, int):
            raise RewardSpecError(self.field("max_concurrency"), "must be an integer")
        self.limits = SandboxLimits(timeout_s=float(timeout), memory_mb=memory)
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix=f"sandbox-{self.name}")

    def grade_batch(self, samples, items):
        tasks = [{"sample": s, "item": i} for s, i in zip(samples, items)]
        size = max(1, min(16, math.ceil(len(tasks) / self.concurrency)))
        chunks = [tasks[k:k + size] for k in range(0, len(tasks), size)]
        raw = [r for part in self._pool.map(lambda c: run_sandboxed(self.source, c, self.limits), chunks)
               for r in part]
        return [r if isinstance(r, GraderError) else _finite(r) for r in raw]

    def budget_s(self, n):
        per_thread = math.ceil(n / self.concurrency)  # samples one thread grades one after another
        return per_thread * (self.limits.timeout_s + 6) + 30

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)


def _finite(value: float) -> float | GraderError:
    if not math.isfinite(value):
        return GraderError("invalid_output", f"grader returned {value}")
    return value

"""The `python` grader: user source ``def grade(sample, item) -> float`` run in the sandbox."""

from __future__ import annotations

import ast
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from gspo_core.rewards.base import Grader, GraderError, RewardSpecError, register
from gspo_core.rewards.isolation import REFUSED, SandboxLimits, isolation_for
from gspo_core.rewards.policy import DEFAULT_POLICY
from gspo_core.rewards.sandbox import START_GRACE_S, run_sandboxed

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
    parallel sandbox children (at most ``max_concurrency``, and only as many as the operator's memory
    budget holds), with per-sample ``timeout_s`` and a ``memory_mb`` address-space cap per child, all
    within the operator's maxima. Refused (a spec error on ``type``) where the host cannot isolate
    user code and the operator did not allow weak isolation. ``image_tag`` (OpenAI's field) is accepted
    and ignored."""

    batched = True

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"source", "timeout_s", "memory_mb", "max_concurrency", "image_tag"})
        self.source = self.req("source", str)
        if len(self.source) > MAX_SOURCE_CHARS:
            raise RewardSpecError(self.field("source"), f"longer than {MAX_SOURCE_CHARS} characters")
        try:
            # A syntax tree only (nothing compiled to code): in "exec" mode, a Module.
            tree = cast(
                ast.Module, compile(self.source, "<grader>", "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
            )
        except SyntaxError as exc:
            raise RewardSpecError(self.field("source"), f"syntax error line {exc.lineno}: {exc.msg}") from None
        except ValueError as exc:  # e.g. a NUL byte
            raise RewardSpecError(self.field("source"), str(exc)) from None
        except (RecursionError, MemoryError):  # the parser's own stack: expressions nested too deeply
            raise RewardSpecError(self.field("source"), "nested too deeply to compile") from None
        if not any(getattr(node, "name", None) == "grade" for node in tree.body):
            raise RewardSpecError(self.field("source"), "must define grade(sample, item) at top level")
        timeout = self.num("timeout_s", 2.0, 0.01, policy.max_timeout_s)
        room = policy.sandbox_memory_budget_mb - SandboxLimits(memory_mb=0).reserve_mb  # the budget less the tmpfs
        memory = self.num("memory_mb", max(64, min(512, policy.max_memory_mb, room)), 64, policy.max_memory_mb)
        if not isinstance(memory, int):
            raise RewardSpecError(self.field("memory_mb"), "must be an integer")
        self.limits = SandboxLimits(timeout_s=float(timeout), memory_mb=memory, niceness=policy.niceness)
        if self.limits.reserve_mb > policy.sandbox_memory_budget_mb:
            raise RewardSpecError(
                self.field("memory_mb"),
                f"with the sandbox's {self.limits.reserve_mb - memory} MB "
                f"of tmpfs it exceeds the operator's sandbox memory budget of "
                f"{policy.sandbox_memory_budget_mb} MB",
            )
        concurrency = self.num(
            "max_concurrency", min(default_concurrency(), policy.max_concurrency), 1, policy.max_concurrency
        )
        if not isinstance(concurrency, int):
            raise RewardSpecError(self.field("max_concurrency"), "must be an integer")
        # Children of one grader never wait for each other's memory: only as many as the budget holds.
        self.concurrency = max(1, min(concurrency, policy.sandbox_memory_budget_mb // self.limits.reserve_mb))
        iso = isolation_for(policy)
        if iso.mode == REFUSED:
            raise RewardSpecError(
                self.field("type"),
                f"python graders are not available on this server: it "
                f"cannot isolate user code ({iso.summary}); the operator may allow weak "
                "isolation (GSPO_ALLOW_WEAK_SANDBOX)",
            )
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix=f"sandbox-{self.name}")

    def grade_batch(self, samples, items):
        calls = [[s, i] for s, i in zip(samples, items, strict=True)]
        size = max(1, min(16, math.ceil(len(calls) / self.concurrency)))
        chunks = [calls[k : k + size] for k in range(0, len(calls), size)]
        raw = [
            r
            for part in self._pool.map(lambda c: run_sandboxed(self.source, c, self.limits, self.policy), chunks)
            for r in part
        ]
        return [r if isinstance(r, GraderError) else _score(r) for r in raw]

    def budget_s(self, n):
        per_thread = math.ceil(n / self.concurrency)  # samples one thread grades one after another
        children = math.ceil(per_thread / 16)  # each pays its start and module code once
        setup = max(self.limits.setup_s, self.limits.timeout_s) + START_GRACE_S
        return children * setup + per_thread * (self.limits.timeout_s + 6) + 30

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)


def _score(value) -> float | GraderError:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return GraderError("invalid_output", f"returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        return GraderError("invalid_output", f"grader returned {value}")
    return value

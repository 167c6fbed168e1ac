"""The operator's rules for graders (isolation, egress, resource caps): one value built from Settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class GraderPolicy:
    """What the operator allows a tenant's graders. The service builds it from its ``Settings``
    (``Settings.grader_policy()``) in the API and in the worker; ``gspo train`` uses the defaults.
    Graders check their spec against it when built (a 422 at submit) and obey it when they run."""

    #: Interpreter of the grader environment that `python` graders run in (None: this interpreter).
    #: It and its prefixes are bound read-only into the sandbox, so an unprivileged uid must be able to read them.
    python: str | None = None
    #: The bubblewrap binary the sandbox runs user code under (a name looked up in PATH, or a path).
    bwrap: str = "bwrap"
    #: Run `python` graders even where the sandbox cannot isolate them (no bubblewrap/user namespaces).
    allow_weak_isolation: bool = False
    #: Largest per-sample ``timeout_s``, per-process ``memory_mb`` and ``max_concurrency`` a `python` grader
    #: may ask for.
    max_timeout_s: float = 60.0
    max_memory_mb: int = 1024
    max_concurrency: int = 8
    #: Megabytes all sandbox children of one process may hold at once (each reserves its memory cap plus
    #: its tmpfs); a child waits for room before it starts.
    sandbox_memory_budget_mb: int = 4096
    #: Hosts or CIDRs that graders' URLs may reach although they are loopback/private (tests, in-cluster judges).
    egress_allow: tuple[str, ...] = ()
    #: Graders run in the grader pool (math_answer, json_schema, text_similarity): seconds per sample
    #: before the sample scores a `timeout` (its process is killed if it does not stop), and per batch.
    local_timeout_s: float = 5.0
    local_budget_s: float = 60.0
    #: Grader pool processes per service process (0: the CPUs, 2..4) and each one's memory beyond its start.
    pool_size: int = 0
    pool_memory_mb: int = 1024
    #: Niceness of the processes graders run in (python sandboxes, the grader pool): the API gives its dry
    #: runs' graders a low priority, so a tenant's CPU-bound grader does not slow other tenants' requests.
    niceness: int = 0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> GraderPolicy:
        """From plain values (``Settings.grader_policy()``); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise TypeError(f"unknown grader policy field(s): {', '.join(sorted(unknown))}")
        out = dict(values)
        if "egress_allow" in out:
            out["egress_allow"] = tuple(out["egress_allow"])
        return cls(**out)


DEFAULT_POLICY = GraderPolicy()

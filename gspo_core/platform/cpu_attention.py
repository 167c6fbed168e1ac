"""vLLM's CPU attention backend declared for 16-token KV blocks too, which its own vec16 kernel runs."""

from __future__ import annotations

import platform
from pathlib import Path

from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend


class CPUAttention16(CPUAttentionBackend):
    """vLLM's CPU attention, unchanged but for the block sizes it declares: multiples of 16, not 32.

    Its kernel selector already runs any block that is not a multiple of 32 on the "vec16" kernel (the
    one models with a head size of 16 mod 32 get at every block size); only the declaration refuses
    them. A 32-token block still gets the kernel it gets with vLLM's own class.
    """

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]


def declare() -> None:
    """Make vLLM resolve its CPU attention backend to `CPUAttention16` in this process, through vLLM's
    public backend registry (``register_backend``, its documented override hook). Idempotent; must run
    before the process's first vLLM engine resolves its backend (vLLM caches the resolved class)."""
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.{CPUAttention16.__qualname__}")


def runs_16_token_blocks(dtype: str, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True where 16-token blocks give up nothing: on x86, vLLM's CPU attention runs 32-token blocks on
    its "vec" kernel and 16-token ones on "vec16", the same kernel for 16-wide tiles -- except bf16 on a
    CPU with AMX, where 32-token blocks get the AMX kernel.

    Decided from the architecture, the precision and the CPU's flags (``amx_tile`` in ``cpuinfo``), not
    by asking vLLM's private kernel selector; ARM, PowerPC or RISC-V CPUs get kernels of their own, which
    16 would give up: those keep 32.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return dtype == "float32" or (dtype == "bfloat16" and "amx_tile" not in _cpu_flags(cpuinfo))


def _cpu_flags(cpuinfo: str) -> set[str]:
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return {"amx_tile"}  # unknown: assume the kernel 16 would give up exists
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())

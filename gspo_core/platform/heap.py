"""The training process's heap policy (glibc): freed tensor memory stays with the process for the next step."""

from __future__ import annotations

import ctypes
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_NEVER = 2**31 - 1  # the largest int mallopt takes: a free top of the heap under 2 GiB stays


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve every allocation from its heap and keep freed heap memory mapped
    (``mallopt``, glibc's documented tuning call). Process-wide: only the process owner calls it,
    through :func:`gspo_core.platform.prepare_process`.

    Why: by default glibc maps each block over 32 MiB (and, adaptively, smaller ones) afresh with
    ``mmap`` and unmaps it on free, so a training step's large tensors -- the gradients, the
    ``[N, V]`` logits and their gradient, the embedding's zero-filled gradient -- come back every
    step as new pages, each one a page fault on first touch (docs/bench.md measures what that costs).
    Kept in the heap, the next step reuses warm pages. The cost: RSS stays at its high-water mark
    until the process exits (the worker runs one job per process).

    Returns False (and changes nothing) where the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it; musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER))


def release_freed_memory() -> bool:
    """Give the kernel back the pages of the heap's free chunks (glibc's documented ``malloc_trim(0)``,
    which also releases free pages inside the heap, not only at its top), whatever :func:`keep_freed_memory`
    set. Why: kept freed memory pays off for what recurs (a step's tensors); what a start-up freed once
    (vLLM's load and the CPU backend's repacking of the weights) is never asked for again at that size,
    yet stays in RSS to the end (docs/bench.md measures it). Returns False where the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True

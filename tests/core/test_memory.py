"""The training process's heap policy: a step's large tensors reuse warm pages instead of faulting new ones."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap policy")

# Ten forward + backward passes of a 512 -> 32k LM head, its gradient dropped after each as the trainer's
# zero_grad(set_to_none=True) does: the [N, V] logits, their gradient and the 64 MiB weight gradient come
# and go every pass. Prints whether the policy was applied and the page faults of passes 2..10.
_PROBE = """
import resource, sys, torch
from gspo_core.platform.heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.manual_seed(0)
head = torch.nn.Linear(512, 32000, bias=False)
x = torch.randn(512, 512)
faults = []
for _ in range(10):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    head(x).logsumexp(-1).sum().backward()
    head.weight.grad = None
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(applied, sum(faults[1:]))
"""


def _probe(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_kept_heap_reuses_pages_the_default_heap_faults_again():
    kept_applied, kept = _probe("keep")
    default_applied, default = _probe("default")
    assert (kept_applied, default_applied) == ("True", "None")
    # glibc's default unmaps each large block on free: ~96 k faults of 4 KiB pages per pass here. Kept,
    # most passes reuse the heap's pages (memalign's split-off tails make some passes carve new ones).
    assert default > 9 * 60_000, default
    assert kept < 0.4 * default, (kept, default)

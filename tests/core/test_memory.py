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


# Start-up's transients under the kept heap: a 256 MiB block freed below a live one (the middle of the heap,
# where glibc's automatic trim never reaches) stays in RSS until release_freed_memory gives its pages back.
_STARTUP = """
import torch
from gspo_core.platform.heap import keep_freed_memory, release_freed_memory

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024

assert keep_freed_memory()
transient = torch.ones(64 * 2**20)  # 256 MiB, touched
live = torch.ones(2**20)  # above it in the heap
del transient
kept = rss_mb()
released = release_freed_memory()
print(released, kept - rss_mb(), float(live.sum()))
"""


def test_start_up_transients_are_given_back_under_the_kept_heap():
    out = subprocess.run([sys.executable, "-c", _STARTUP], capture_output=True, text=True, check=True)
    released, dropped_mb, live = out.stdout.split()
    assert released == "True" and float(live) == 2**20
    assert int(dropped_mb) >= 200, dropped_mb


# The subprocess scripts' reading of /proc/self/status (VmRSS, VmHWM), in MiB.
_RSS_MB = """
def rss_mb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
"""


# Two micro-batches' forward + backward of a one-layer Llama whose 32k x 512 embedding (64 MiB) is its LM head
# (tied), under glibc's default heap (blocks this large are mapped and unmapped: the peak RSS is the peak of live
# memory). Prints the rise of the peak over the model's own RSS, in MiB.
_TIED = (
    _RSS_MB
    + """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from gspo_core.packing import pack
from gspo_core.policy import completion_logprobs, one_tied_gradient

torch.manual_seed(0)
config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)
model = LlamaForCausalLM(config)
one = sys.argv[1] == "one" and one_tied_gradient(model)
batch = pack([[1, 2, 3]] * 4, [[4, 5, 6, 7]] * 4, 0)
completion_logprobs(model, batch, 1.0)  # first-call allocations out of the way
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from here
base = rss_mb("VmRSS")
for _ in range(2):
    completion_logprobs(model, batch, 1.0).sum().backward()
print(one, rss_mb("VmHWM") - base)
"""
)


def test_a_tied_embeddings_gradient_is_one_buffer():
    """The tied weight's gradient, over micro-batches: autograd holds the head's [V, H], the embedding's dense
    one and (from the second micro-batch) the .grad they are added to, ~3 x 64 MiB at once; with the embedding's
    made sparse and the head's added straight into .grad (gspo_core.policy.one_tied_gradient), only .grad."""
    peaks = {}
    for mode in ("dense", "one"):
        out = subprocess.run([sys.executable, "-c", _TIED, mode], capture_output=True, text=True, check=True)
        one, rise = out.stdout.split()
        assert one == str(mode == "one")
        peaks[mode] = float(rise)
    assert peaks["dense"] > 2.5 * 64, peaks
    assert peaks["one"] < 1.5 * 64, peaks


# One backward of the fused LM head over 512 positions of a 32k vocabulary with its logits kept (64 MiB), under
# glibc's default heap. Prints the rise of the peak RSS over the RSS after the forward, in MiB.
_HEAD = (
    _RSS_MB
    + """
import torch
from gspo_core.token_logprobs import head_logprobs

torch.manual_seed(0)
head = torch.nn.Linear(16, 32000, bias=False)
h = torch.randn(512, 16, requires_grad=True)
target = torch.randint(0, 32000, (512,))
head_logprobs(h[:8], head, target[:8])[0].sum().backward()  # first-call allocations out of the way
logp = head_logprobs(h, head, target)[0]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from here
base = rss_mb("VmRSS")
logp.sum().backward()
print(rss_mb("VmHWM") - base)
"""
)


def test_the_head_backward_makes_no_second_logits_sized_buffer():
    """The kept logits are turned into their gradient in place (gspo_core.token_logprobs): the backward adds
    the 2 MiB weight gradient and a few blocks (4 MiB on an Intel machine, 20 on an AMD one: glibc's arenas
    differ), not a second 64 MiB [F, V] (78 MiB before)."""
    out = subprocess.run([sys.executable, "-c", _HEAD], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 40, out.stdout

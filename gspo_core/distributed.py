"""The trainer as an SPMD program: its process group, FSDP2 sharding of the policy, and the collectives a step needs."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from gspo_core.launch import launched
from gspo_core.policy import Policy, base_model, completion_logprobs, one_tied_gradient, save_hf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.losses import LossMetrics
    from gspo_core.packing import PackedBatch, SharedPrefixBatch

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: ``rank`` of ``world`` ranks, one per device."""

    rank: int
    world: int

    @property
    def main(self) -> bool:
        """Rank 0: it samples, scores, reports and writes checkpoints. The one test of the rank: the job and the
        primitives take rank 0's parts from :meth:`lead` (and `lead_writer`), built once, never test it."""
        return self.rank == 0

    def lead(self, make: Callable[[], T]) -> T | None:
        """``make()`` on rank 0, None on the others: a part of the job that rank 0 alone holds for every rank
        (its sampler, graders, tools, callbacks, the writer of its files), built where the job is built. The
        steps then never test the rank: they hand rank 0's results to every rank (`broadcast`,
        `gspo_core.gspo_loop.shared`)."""
        return make() if self.main else None


class LeadWriter:
    """Writes the files one rank writes for every rank (an export, a checkpoint's own files): rank 0's writer
    writes them, the other ranks' (`NoWrites`) do nothing, so the code that writes runs alike on every rank.
    Chosen once where a job or session is built (:func:`lead_writer`)."""

    def save(self, obj: Any, path: Path) -> None:
        torch.save(obj, path)

    def export(
        self,
        model: Policy,
        tokenizer: PreTrainedTokenizerBase,
        path: Path,
        state: dict[str, torch.Tensor],
        adapter_dir: Path | None = None,
    ) -> None:
        """`gspo_core.policy.save_hf` of ``state`` (gathered: whole on rank 0 alone)."""
        save_hf(model, tokenizer, path, state, adapter_dir=adapter_dir)

    def remove(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def replace(self, tmp: Path, final: Path) -> None:
        """``tmp`` renamed ``final``, whatever was there removed first."""
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)


class NoWrites(LeadWriter):
    """Ranks 1..N-1's writer: rank 0 writes for them."""

    def save(self, obj: Any, path: Path) -> None:
        pass

    def export(self, *args: Any, **kwargs: Any) -> None:
        pass

    def remove(self, path: Path) -> None:
        pass

    def replace(self, tmp: Path, final: Path) -> None:
        pass


def lead_writer(ranks: Ranks) -> LeadWriter:
    """This rank's writer: rank 0's writes, the others' do nothing."""
    return ranks.lead(LeadWriter) or NoWrites()


def local_device() -> torch.device:
    """This rank's device: its GPU (the launcher's LOCAL_RANK) or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def join_group(device: torch.device, timeout_s: int = 1800) -> Ranks:
    """Join the job's process group (NCCL on GPU, gloo on CPU) when this process is one of its ranks
    (`gspo_core.launch.launched`: started by `gspo_core.launch.other_ranks` or by torchrun); a process run
    alone makes a 1-rank group (an in-process store, no port), so one program serves every N. A group already
    made in this process (an earlier job, or an in-process vLLM engine's) is reused: a process has one default
    group.
    ``timeout_s``: how long a collective waits for a rank (`RuntimeOptions.rank_timeout_s`); past it the
    collective raises (gloo) or the watchdog ends the process (NCCL), and the attempt is lost, not hung."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if launched():
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Ranks(dist.get_rank(), dist.get_world_size())


class ShardedPolicy(torch.nn.Module):
    """The FSDP2 root around the policy. Its forward is :func:`gspo_core.policy.completion_logprobs`: the
    trainer runs the policy's trunk and LM head itself (not the model's forward), so the root's forward is
    where the shards of the embeddings, final norm and head are gathered and their gradients reduced."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def forward(
        self,
        batch: PackedBatch | SharedPrefixBatch | None,
        temperature: float,
        amp_dtype: torch.dtype | None = None,
        with_entropy: bool = False,
    ) -> Any:
        if batch is None:  # a call with no batch only sets FSDP up (see `shard`)
            return None
        if with_entropy:
            return completion_logprobs(self.policy, batch, temperature, amp_dtype, with_entropy=True)
        return completion_logprobs(self.policy, batch, temperature, amp_dtype)


def shard(policy: Policy, device: torch.device, amp_dtype: torch.dtype | None, ranks: Ranks) -> ShardedPolicy:
    """FSDP2 over the process group: each transformer block (the model's ``_no_split_modules``) is a unit,
    the rest (embeddings, norm, head) the root's; parameters, gradients and optimizer state are sharded.
    bf16 mixed precision on GPU only (gloo reduces no bf16 faster, and CPU jobs train in fp32).

    One rank has nothing to share its shards with: the root is left a plain module there (FSDP2 would only
    copy every parameter into its buffers and back around each forward and backward, and run AdamW on
    DTensors; docs/scaling.md), and a tied embedding's gradient is made in one buffer
    (`gspo_core.policy.one_tied_gradient`). Everything else about the program is the same."""
    root = ShardedPolicy(policy)
    if ranks.world == 1:
        one_tied_gradient(policy)
        return root
    mixed = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda" and amp_dtype == torch.bfloat16
        else MixedPrecisionPolicy()
    )
    blocks = set(getattr(base_model(policy), "_no_split_modules", None) or ())
    for module in list(policy.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mp_policy=mixed)
    fully_shard(root, mp_policy=mixed)
    for unit in units(root):
        # Each rank's loss is its rows' share of the whole mini-batch's mean: the gradients add up (the
        # default would average them over ranks).
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum; a factor of 1 needs none
    # FSDP2 makes the first unit to run forward its root, and sampling runs the blocks alone (`full_weights`):
    # a call of the root first, on every rank. It keeps its parameters gathered after it: the optimizer must
    # take the shards.
    root(None, 1.0)
    cast(FSDPModule, root).reshard()
    return root


def units(root: torch.nn.Module) -> list[FSDPModule]:
    return [module for module in root.modules() if isinstance(module, FSDPModule)]


@contextlib.contextmanager
def full_weights(root: ShardedPolicy) -> Iterator[None]:
    """Every rank holds the whole policy while inside (a collective to enter and to leave), so one rank can
    run it alone, e.g. sample with it: no unit reshards after a forward until the exit."""
    fsdp_units = units(root)
    if not fsdp_units:  # not sharded: the policy is whole already
        yield
        return
    blocks = [unit for unit in fsdp_units if unit is not root]
    for unit in blocks:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in fsdp_units:
        unit.unshard()
    try:
        yield
    finally:
        # Reshards every unit, and forgets the forwards run inside: FSDP orders its backward prefetches by
        # the forwards it saw, and one rank's sampling must not make its order differ from the others'.
        cast(FSDPModule, root).reset_iter_state()
        for unit in blocks:
            unit.set_reshard_after_forward(True, recurse=False)


def gather_state_dict(policy: Policy, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """The policy's full state dict (its own names) on rank 0's CPU, a tensor at a time; empty on the other
    ranks. ``everywhere``: on every rank, on its own device (a push each rank takes part in). A collective:
    every rank calls it. Unsharded (one rank): the live tensors, as they are."""
    if not units(policy):
        return policy.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    return cast(dict[str, torch.Tensor], get_model_state_dict(policy, options=options))


#: The trainer state DCP keeps: trainable parameters only (a LoRA job's frozen base is its base model's).
SHARDED = StateDictOptions(ignore_frozen_params=True)


#: torch's DCP file writer (seen in 2.11 and 2.13) keeps the host copy of every tensor of a file until the whole
#: file is written (its ``tensor_dict``, which only a safetensors file needs): one file a rank held a GPU rank's
#: whole trainer state in host memory at once (weights and AdamW's moments, 6 GB of a 0.5B model's;
#: docs/bench.md, GPU). Off the CPU each tensor goes to a file of its own instead, so one copy at a time is
#: held. tests/core/test_checkpoint.py fails once torch lets the copies go.
DCP_HOLDS_FILE_COPIES = torch.__version__ < "2.15"  # a TorchVersion: compared as a version


def checkpoint_writer(path: Path, device: torch.device) -> FileSystemWriter:
    """DCP's file writer for a rank whose state lies on ``device`` (see :data:`DCP_HOLDS_FILE_COPIES`)."""
    one_file = device.type == "cpu" or not DCP_HOLDS_FILE_COPIES
    return FileSystemWriter(path, single_file_per_rank=one_file)


def save_sharded(policy: Policy, optimizer: torch.optim.Optimizer, path: Path, with_optimizer: bool = True) -> None:
    """Each rank writes its own shards of the trainable weights and (``with_optimizer``) their optimizer state
    under ``path`` with ``torch.distributed.checkpoint`` (rank 0 adds the metadata: every tensor's global shape
    and where each piece lies), so nothing is gathered. A collective; one rank writes whole tensors."""
    model_state, optimizer_state = get_state_dict(policy, optimizer, options=SHARDED)
    state = {"model": model_state, "optimizer": optimizer_state} if with_optimizer else {"model": model_state}
    device = next(policy.parameters()).device
    dcp.save(state, checkpoint_id=path, storage_writer=checkpoint_writer(path, device))


def load_sharded(policy: Policy, optimizer: torch.optim.Optimizer, path: Path, with_optimizer: bool = True) -> None:
    """Read this rank's shards of a :func:`save_sharded` directory into the policy and (``with_optimizer``)
    the optimizer, whatever the number of ranks that wrote it: DCP reads each rank's piece of every tensor
    from the saved pieces it overlaps (resharding). A collective."""
    model_state, optimizer_state = get_state_dict(policy, optimizer, options=SHARDED)
    state = {"model": model_state, "optimizer": optimizer_state} if with_optimizer else {"model": model_state}
    dcp.load(state, checkpoint_id=path)  # fills them in place
    # Not strict: the frozen parameters are absent on purpose (a trainable one missing fails in dcp.load).
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    if with_optimizer:
        set_state_dict(
            policy, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options
        )
    else:
        set_model_state_dict(policy, model_state, options=options)


def load_full_state(
    policy: Policy, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
) -> None:
    """Load full (unsharded, by-name) ``weights`` (some of the policy's) and optimizer state into this rank's
    shards; every rank reads the checkpoint itself (checkpoints written before :func:`save_sharded`)."""
    set_model_state_dict(
        policy, cast(dict[str, Any], weights), options=StateDictOptions(full_state_dict=True, strict=False)
    )
    set_optimizer_state_dict(policy, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients to ``max_norm`` over the whole model (every rank's shards) and return the norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def broadcast(value: T | None, ranks: Ranks) -> T:
    """Rank 0's ``value`` on every rank (pickled; for rollouts, scores and decisions, not weights); the
    other ranks pass None."""
    box = [value]
    if ranks.world > 1:
        dist.broadcast_object_list(box, src=0)
    assert box[0] is not None, "rank 0 has the value"
    return box[0]


def gather(value: T, ranks: Ranks) -> list[T]:
    """Every rank's ``value``, in rank order, on every rank."""
    if ranks.world == 1:
        return [value]
    out: list[Any] = [None] * ranks.world
    dist.all_gather_object(out, value)
    return out


def barrier(ranks: Ranks) -> None:
    if ranks.world > 1:
        dist.barrier()


def most(value: int, ranks: Ranks) -> int:
    """The largest ``value`` of any rank."""
    if ranks.world == 1:
        return value
    box = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())


def everywhere(flag: bool, ranks: Ranks) -> bool:
    """Whether ``flag`` holds on every rank."""
    return -most(-int(flag), ranks) == 1


def merge_loss_metrics(metrics: LossMetrics, ranks: Ranks) -> LossMetrics:
    """The mini-batch's metrics over all ranks' rows (each rank added up only its own)."""
    if ranks.world == 1:
        return metrics
    total, *others = gather(metrics, ranks)
    for other in others:
        total.loss += other.loss
        total.entropy += other.entropy
        total.tokens += other.tokens
        total.weight += other.weight
        for name, value in other.weighted.items():
            total.weighted[name] = total.weighted.get(name, 0.0) + value
        total.low, total.high = min(total.low, other.low), max(total.high, other.high)
    return total

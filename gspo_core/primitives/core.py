"""The one code path of every training primitive: a batch's forward, loss and backward; an optimizer update."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gspo_core.batching import pack
from gspo_core.config import GSPOConfig
from gspo_core.distributed import Ranks, clip_grad_norm, everywhere
from gspo_core.packing import PackedBatch, SharedPrefixBatch
from gspo_core.policy import Policy, completion_logprobs
from gspo_core.rollout.base import Completion

#: A loss over a batch's log-probs ``logp_BT``: the scalar to differentiate, and its metrics.
LossOf = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class PolicyState:
    """The policy's training state: the model, its optimizer and LR schedule (None: the caller sets each
    step's rate), the autocast dtype of its forwards (None: fp32), and the pad token id of its batches.
    Sharded over ``ranks``, ``sharded`` is its FSDP root (`gspo_core.distributed.ShardedPolicy`), whose
    forward is :func:`completion_logprobs`; each rank runs its share of every batch's rows."""

    model: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    amp: torch.dtype | None
    pad_id: int
    sharded: torch.nn.Module | None = None
    ranks: Ranks = field(default_factory=lambda: Ranks(0, 1))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The optimizer's own parameters (a sharded module's registered ones are the gathered ones after a
        no-grad forward)."""
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def logprobs(self, batch, temperature: float, with_entropy: bool = False):
        """:func:`completion_logprobs` of ``batch`` by the current weights (through the FSDP root when sharded)."""
        if self.sharded is not None:
            return self.sharded(batch, temperature, self.amp, with_entropy)
        if with_entropy:
            return completion_logprobs(self.model, batch, temperature, self.amp, with_entropy=True)
        return completion_logprobs(self.model, batch, temperature, self.amp)

    def pack(
        self, completions: list[Completion], idx: torch.Tensor, cfg: GSPOConfig
    ) -> PackedBatch | SharedPrefixBatch:
        """Rows ``idx`` as one forward batch (`gspo_core.batching.pack`), on the policy's device. The ranks'
        forwards must call the same modules in the same order (FSDP gathers each as it runs): the rows share
        prompt passes only where every rank's do."""
        batch = pack(completions, idx, self.pad_id, cfg)
        if not everywhere(isinstance(batch, SharedPrefixBatch), self.ranks):
            batch = pack(completions, idx, self.pad_id, cfg, share=False)
        return batch.to(self.device)

    def share(self, rows_B: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of ``rows_B`` (all of them on one rank)."""
        return torch.tensor_split(rows_B, self.ranks.world)[self.ranks.rank]


@dataclass(frozen=True)
class LossPass:
    """One batch's forward and backward: its log-probs ``logp_BT`` (detached), mean token entropy, loss, metrics."""

    logp_BT: torch.Tensor
    entropy: float
    loss: torch.Tensor
    metrics: dict[str, float]


def loss_backward(
    policy: PolicyState,
    batch: PackedBatch | SharedPrefixBatch,
    loss_of: LossOf,
    scale: float = 1.0,
    temperature: float = 1.0,
) -> LossPass:
    """Forward ``batch``, take ``loss_of`` its log-probs, and accumulate the gradient of ``scale`` times it
    (a collective when sharded: every rank calls it as often, a rank with no rows on a stand-in with scale 0)."""
    logp_BT, entropy = policy.logprobs(batch, temperature, with_entropy=True)
    loss, metrics = loss_of(logp_BT)
    (loss * scale).backward()
    return LossPass(logp_BT.detach(), entropy, loss.detach(), metrics)


def optimizer_update(policy: PolicyState, max_grad_norm: float) -> float:
    """Clip the accumulated gradients to ``max_grad_norm`` over every rank's shards (inf: no clip), apply one
    optimizer step and zero the gradients; returns the norm before clipping. A parameter no loss reached
    steps with a zero gradient (AdamW's moments and weight decay still move), as every rank must."""
    params = policy.params
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grad_norm = clip_grad_norm(params, max_grad_norm)
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    return grad_norm

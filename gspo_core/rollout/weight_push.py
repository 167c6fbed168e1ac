"""The trainer's side of a weight push through vLLM's RL API, one transport per topology."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gspo_core.rollout import weight_transfer

if TYPE_CHECKING:
    from vllm import LLM

Weights = list[tuple[str, torch.Tensor]]


def backend_for(*, multiprocess: bool, world_size: int) -> str:
    """In the trainer's process (one rank, vLLM in-process) the tensors are handed over; else broadcast."""
    return weight_transfer.IN_PROCESS if not multiprocess and world_size == 1 else weight_transfer.GLOO


def checkpoint_names(model_dir: str) -> set[str] | None:
    """The tensor names of the checkpoint vLLM loaded (safetensors headers only, no tensor is read);
    None for a checkpoint in another format, whose pushes then go unchecked."""
    from safetensors import safe_open

    paths = sorted(Path(model_dir).glob("*.safetensors"))
    if not paths:
        return None
    names: set[str] = set()
    for path in paths:
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    return names


def unknown_names(names: Iterable[str], known: set[str] | None, *, tied_embeddings: bool) -> list[str]:
    """Pushed names the engine's model would not know. A failed update leaves vLLM's layers half-loaded
    (no rollback; the next forward kills the engine), so they are refused before the update starts.
    Tolerated beyond the checkpoint's: a tied ``lm_head.weight`` (vLLM skips it), and the fused expert
    tensors transformers 5 holds in memory where the checkpoint has per-expert ones (vLLM's MoE loaders
    for such models read both)."""
    if known is None:
        return []
    bad = []
    for name in names:
        if name in known or (tied_embeddings and name == "lm_head.weight"):
            continue
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj") and f"{prefix}.0.{leaf.split('_')[0]}_proj.weight" in known:
            continue
        bad.append(name)
    return bad


class InProcessPush:
    """vLLM's worker is in this process: hand it the tensors themselves."""

    def connect(self, llm: LLM) -> None:
        llm.init_weight_transfer_engine({"init_info": {}})

    def send(self, llm: LLM, weights: Weights) -> None:
        handle = weight_transfer.hand_over(weights)
        try:
            llm.update_weights({"update_info": {"handle": handle}})
        finally:
            weight_transfer.withdraw(handle)


class GlooPush:
    """vLLM's workers are other processes: the trainer is rank 0 of a gloo group with every worker and
    broadcasts each tensor, while vLLM's blocking ``update_weights`` runs on a helper thread."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.group: Any = None

    def connect(self, llm: LLM) -> None:
        world = self.world_size + 1
        # Hosted here on a port the store binds itself (no probe-then-bind race); workers connect to it.
        store = torch.distributed.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=weight_transfer.GLOO_TIMEOUT, wait_for_workers=False
        )

        def join() -> None:
            self.group = weight_transfer.gloo_group(store, 0, world)

        info = {"host": "127.0.0.1", "port": store.port, "world_size": world}
        _while(lambda: llm.init_weight_transfer_engine({"init_info": info}), join)

    def send(self, llm: LLM, weights: Weights) -> None:
        info = {
            "names": [name for name, _ in weights],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in weights],
            "shapes": [list(tensor.shape) for _, tensor in weights],
        }

        def broadcast() -> None:
            for _, tensor in weights:
                self.group.broadcast(tensor.contiguous(), 0).wait()

        _while(lambda: llm.update_weights({"update_info": info}), broadcast)


def _while(rpc: Callable[[], None], local: Callable[[], None]) -> None:
    """Run vLLM's blocking call on a thread while this one does the trainer's half of the exchange."""
    errors: list[BaseException] = []

    def call() -> None:
        try:
            rpc()
        except BaseException as exc:  # re-raised below, on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=call, name="vllm-weight-transfer", daemon=True)
    thread.start()
    local()
    thread.join()
    if errors:
        raise errors[0]

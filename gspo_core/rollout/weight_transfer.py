"""Our weight-transfer engines for vLLM's RL API: an in-process hand-over, and gloo across processes."""

from __future__ import annotations

import contextlib
import gc
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

#: The backend names, as `vllm.LLM(weight_transfer_config={"backend": ...})` takes them.
IN_PROCESS = "gspo_in_process"
GLOO = "gspo_gloo"

#: How long a gloo rank waits for its peer: a side that failed mid-push must not leave the other blocked
#: for torch's default half hour (a push of the 55 M small shape takes about a second).
GLOO_TIMEOUT = timedelta(minutes=5)

#: Weights handed over in this process, by handle: the trainer puts an iterable here and names its handle in
#: ``update_weights``; the engine, in the same process, takes it out and loads it as it iterates (no copy).
_HANDOVERS: dict[str, Iterable[tuple[str, torch.Tensor]]] = {}


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM runs it in every process it starts (API server, engine
    core, workers), so the workers' factory knows our backends, and the platform registers what it needs
    there (`Platform.in_vllm_process`). Safe to run more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from gspo_core.platform import current

    # vLLM's start-up runs full collections over the whole heap (two around loading the weights, one before it
    # freezes the heap itself): ~0.7 CPU s each in a job's process, whose imports of torch, transformers and
    # vLLM left ~700k objects that live as long as it does. Frozen now, those collections scan only what the
    # engine allocates (tests/core/test_rollout_vllm.py). vLLM freezes the whole heap once it has started
    # anyway, and unfreezes it at its shutdown: this changes when, not what.
    gc.freeze()
    current().in_vllm_process()

    for name, cls in ((IN_PROCESS, "InProcessEngine"), (GLOO, "GlooEngine")):
        # Registered already: by the entry point and by VLLMEngine, in one process.
        with contextlib.suppress(ValueError):
            WeightTransferEngineFactory.register_engine(name, __name__, cls)


def gloo_group(store: torch.distributed.Store, rank: int, world_size: int) -> Any:
    """A gloo group of its own over ``store`` (hosted by the trainer, rank 0), in no registry: a stateless
    group beside any default group either side has. The store is made explicitly, not by a ``tcp://``
    rendezvous: under torchrun (a trainer rank, and the vLLM workers it starts, inherit its environment)
    torch turns that rendezvous into a client of torchrun's agent store, and no process would host ours."""
    from vllm.distributed.utils import init_gloo_process_group

    return init_gloo_process_group(torch.distributed.PrefixStore(GLOO, store), rank, world_size, GLOO_TIMEOUT)


def hand_over(weights: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Park ``weights`` for this process's in-process engine; returns the handle ``update_weights`` names."""
    handle = uuid.uuid4().hex
    _HANDOVERS[handle] = weights
    return handle


def withdraw(handle: str) -> None:
    """Drop a parked hand-over (an update that failed before the engine took it)."""
    _HANDOVERS.pop(handle, None)


class _LayerwiseReload(WeightTransferEngine):
    """The update lifecycle both engines share: vLLM's layer-wise reload around the model's own
    ``load_weights`` (checkpoint-format names), then the platform's fix-ups."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises torch.accelerator, which has no device to sync on CPU.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from gspo_core.platform import current

        finalize_layerwise_reload(self.model, self.model_config)
        current().after_weight_update(self.model)

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(weights)


@dataclass
class InProcessInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: trainer and worker share the process."""


@dataclass
class InProcessUpdateInfo(WeightTransferUpdateInfo):
    handle: str


class InProcessEngine(_LayerwiseReload):
    """The worker runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank): it
    loads the trainer's tensors straight from the hand-over, consuming a lazy export while it is live."""

    init_info_cls = InProcessInitInfo
    update_info_cls = InProcessUpdateInfo

    def init_transfer_engine(self, init_info: InProcessInitInfo) -> None:
        pass

    def receive_weights(self, update_info: InProcessUpdateInfo) -> None:
        weights = _HANDOVERS.pop(update_info.handle, None)
        if weights is None:
            raise RuntimeError(
                f"no weights handed over as {update_info.handle!r} in this process: backend {IN_PROCESS!r} "
                f"needs the vLLM worker in the trainer's process (use {GLOO!r} across processes)"
            )
        self._load(weights)

    def shutdown(self) -> None:
        pass


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer (rank 0 of a gloo group of ``world_size``) listens; workers take ranks 1..."""

    host: str
    port: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One round's tensors, in the order the trainer broadcasts them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooEngine(_LayerwiseReload):
    """Workers in other processes (multiprocess mode, tensor parallelism): every worker receives each
    full HF tensor by a gloo broadcast from the trainer and its model's ``load_weights`` shards it."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = 1 + parallel.data_parallel_index * parallel.world_size + parallel.rank
        store = torch.distributed.TCPStore(
            init_info.host, init_info.port, init_info.world_size, is_master=False, timeout=GLOO_TIMEOUT
        )
        self.group = gloo_group(store, rank, init_info.world_size)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        self._load(self._received(update_info))

    def _received(self, info: GlooUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast(tensor, 0).wait()
            yield name, tensor

    def shutdown(self) -> None:
        self.group = None  # a stateless group is in no registry: dropping it closes it

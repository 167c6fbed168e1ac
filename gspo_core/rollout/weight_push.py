"""The trainer's side of a weight push: vLLM's trainer-side weight-transfer protocol, one transport per topology."""

from __future__ import annotations

import base64
import contextlib
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from gspo_core.rollout import weight_transfer
from gspo_core.rollout.base import Completion, SamplingSpec

if TYPE_CHECKING:
    from vllm import LLM

Weights = list[tuple[str, torch.Tensor]]

#: vLLM's own CUDA IPC engines (worker and trainer side, `vllm.distributed.weight_transfer.ipc_engine`).
IPC = "ipc"


def backend_for(*, device_type: str, multiprocess: bool, world_size: int) -> str:
    """vLLM in the trainer's process (one rank): the tensors are handed over. In processes of its own on GPUs:
    CUDA IPC, each vLLM rank reading the copy on the GPU it shares with a trainer rank (NCCL cannot join two
    processes on one GPU, docs/scaling.md). On CPU: a gloo broadcast."""
    if not multiprocess and world_size == 1:
        return weight_transfer.IN_PROCESS
    return IPC if device_type == "cuda" else weight_transfer.GLOO


def every_rank_sends(backend: str) -> bool:
    """Whether every trainer rank hands its own full copy of each tensor to the push (CUDA IPC: each vLLM
    rank opens the copy on its GPU), or rank 0 alone sends what was gathered to it."""
    return backend == IPC


def trainer_init_info(backend: str, rank: int, vllm_ranks: int) -> TrainerInitInfo:
    """The trainer-side init info of ``backend`` for trainer rank ``rank`` (rank 0 sends)."""
    if backend == IPC:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        # Packed: each rank stages the tensors through one bounded buffer, not a second copy of the model.
        return IPCTrainerInitInfo(rank=rank, packed=True)
    if backend == weight_transfer.GLOO:
        return GlooInitInfo(rank=rank, vllm_ranks=vllm_ranks)
    return InProcessInitInfo(rank=rank)


def register() -> None:
    """Our trainer-side engines in vLLM's trainer factory (its own `ipc` is registered by vLLM). Safe to run
    more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    for name, cls in ((weight_transfer.IN_PROCESS, "InProcessTrainer"), (weight_transfer.GLOO, "GlooTrainer")):
        with contextlib.suppress(ValueError):  # registered already in this process
            WeightTransferTrainerFactory.register_engine(name, __name__, cls)


def connect(backend: str, rank: int, vllm_ranks: int, client: VLLMWeightSyncClient, source: Pushed) -> Any:
    """This trainer rank's engine for ``backend``, through vLLM's trainer factory; rank 0 initialises vLLM's
    side through ``client``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register()
    return WeightTransferTrainerFactory.trainer_init(
        trainer_init_info(backend, rank, vllm_ranks), client=client, source=source
    )


class Push:
    """One trainer rank's side of the pushes: its engine from vLLM's trainer factory, fed one push at a time.
    Rank 0's drives vLLM (``client``); the others' take part in the collectives a transport needs."""

    shares_weights = False

    def __init__(self, backend: str, rank: int, vllm_ranks: int, client: VLLMWeightSyncClient) -> None:
        self.push_backend = backend
        self.source = Pushed()
        self.engine = connect(backend, rank, vllm_ranks, client, self.source)

    def send(self, weights: Weights) -> None:
        self.source.weights = weights
        try:
            self.engine.send_weights()
        finally:
            self.source.weights = []

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A rank's part of a push (`gspo_core.step.push_weights`): ranks 1..N-1 have no engine of their own."""
        self.send([(name, tensor.detach()) for name, tensor in named_tensors])

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self.engine.shutdown()


class PeerEngine:
    """The engine of ranks 1..N-1 where every rank sends its own copy of the weights (CUDA IPC): it samples
    nothing (rank 0's engine does) and takes part in each of rank 0's pushes through its `Push`, so a sampling
    session over it pushes as rank 0's does (`gspo_core.primitives.SamplingSession.push`)."""

    name = "peer"
    shares_weights = False

    def __init__(self, backend: str, rank: int, vllm_ranks: int) -> None:
        self.push_backend = backend
        self.push = Push(backend, rank, vllm_ranks, NoEngine())

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        raise RuntimeError("only trainer rank 0's engine samples")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.push.load_weights(named_tensors)

    def wake(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        self.push.close()


class Pushed(WeightSource):
    """The weights of the push under way, as vLLM loads them (checkpoint names, LoRA merged): the trainer
    sets them before each push; every engine iterates them once."""

    def __init__(self) -> None:
        self.weights: Weights = []

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.weights]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.weights)


class LLMClient:
    """vLLM's `VLLMWeightSyncClient` protocol over an offline `LLM` (whose RL methods take request wrappers).
    CUDA IPC handles hold torch types that vLLM's engine-core messages do not carry: they go pickled, the way
    vLLM's worker engine reads them over HTTP (it needs ``VLLM_ALLOW_INSECURE_SERIALIZATION``, which the
    platform sets for the job's own engine: `gspo_core.platform.Platform.prepare_job`)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": portable(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def portable(update_info: Any) -> Any:
    """An update's info as vLLM's engine-core messages carry it: CUDA IPC handles pickled into
    ``ipc_handles_pickled`` (vLLM's IPC worker engine unpickles them); other backends' info as it is."""
    if not isinstance(update_info, dict) or update_info.get("ipc_handles") is None:
        return update_info
    handles = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode()
    return {**update_info, "ipc_handles": None, "ipc_handles_pickled": handles}


class NoEngine:
    """The client of ranks 1..N-1: they take part in a push's collectives; only rank 0 drives vLLM."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("only trainer rank 0 drives the vLLM engine")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _refuse


@dataclass
class InProcessInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = weight_transfer.IN_PROCESS


class InProcessTrainer(TrainerWeightTransferEngine[InProcessInitInfo]):
    """vLLM's worker is in this process: it is handed the tensors themselves."""

    init_info_cls = InProcessInitInfo

    @classmethod
    def trainer_init(
        cls, init_info: InProcessInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self) -> None:
        if not self.is_sender or self.source is None:
            return
        handle = weight_transfer.hand_over(self.source)
        self.client.start_weight_update()
        try:
            self.client.update_weights({"handle": handle})
        finally:
            weight_transfer.withdraw(handle)
            self.client.finish_weight_update()


@dataclass
class GlooInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = weight_transfer.GLOO
    vllm_ranks: int = 1


class GlooTrainer(TrainerWeightTransferEngine[GlooInitInfo]):
    """vLLM's workers are other processes: rank 0 is rank 0 of a gloo group with every worker and broadcasts
    each tensor (gathered to it), while vLLM's blocking ``update_weights`` runs on a helper thread."""

    init_info_cls = GlooInitInfo
    group: Any = None

    @classmethod
    def trainer_init(
        cls, init_info: GlooInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        world = init_info.vllm_ranks + 1
        # Hosted here on a port the store binds itself (no probe-then-bind race); workers connect to it.
        store = torch.distributed.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=weight_transfer.GLOO_TIMEOUT, wait_for_workers=False
        )

        def join() -> None:
            engine.group = weight_transfer.gloo_group(store, 0, world)

        info = {"host": "127.0.0.1", "port": store.port, "world_size": world}
        _while(lambda: client.init_weight_transfer_engine(info), join)
        return engine

    def send_weights(self) -> None:
        if not self.is_sender or self.source is None:
            return
        weights = [(name, tensor.detach().cpu().contiguous()) for name, tensor in self.source]
        info = {
            "names": [name for name, _ in weights],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in weights],
            "shapes": [list(tensor.shape) for _, tensor in weights],
        }

        def broadcast() -> None:
            for _, tensor in weights:
                self.group.broadcast(tensor, 0).wait()

        self.client.start_weight_update()
        try:
            _while(lambda: self.client.update_weights(info), broadcast)
        finally:
            self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = None


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

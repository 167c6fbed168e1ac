"""The push's transport per topology, and the CUDA IPC update as vLLM's engine-core messages carry it (the
parts of the GPU transport that run without a GPU; the CPU transports run in tests/core/test_spmd.py)."""

from __future__ import annotations

import pytest
import torch

from gspo_core.rollout import vllm_available

pytestmark = pytest.mark.vllm
if not vllm_available():
    pytest.skip("vllm not installed", allow_module_level=True)

from gspo_core.rollout import weight_push, weight_transfer  # noqa: E402


@pytest.mark.parametrize(
    ("device_type", "multiprocess", "world_size", "backend"),
    [
        ("cpu", False, 1, weight_transfer.IN_PROCESS),
        ("cuda", False, 1, weight_transfer.IN_PROCESS),  # the worker is in the trainer's process: no copy
        ("cpu", True, 1, weight_transfer.GLOO),
        ("cpu", True, 2, weight_transfer.GLOO),
        ("cuda", True, 1, weight_push.IPC),
        ("cuda", True, 2, weight_push.IPC),  # each vLLM rank on the GPU of a trainer rank: NCCL cannot pair them
    ],
)
def test_the_transport_follows_the_topology(device_type, multiprocess, world_size, backend):
    assert weight_push.backend_for(device_type=device_type, multiprocess=multiprocess, world_size=world_size) == backend
    assert weight_push.every_rank_sends(backend) == (backend == weight_push.IPC)


def test_every_backend_has_a_trainer_engine_in_vllms_factory():
    """Each backend's trainer-side init info is vLLM's own (CUDA IPC) or names one of ours, which vLLM's public
    trainer factory builds: at a rank other than 0 it sends nothing and never drives vLLM (its client
    refuses to)."""
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    ipc = weight_push.trainer_init_info(weight_push.IPC, rank=1, vllm_ranks=2)
    assert isinstance(ipc, IPCTrainerInitInfo) and ipc.packed and not ipc.is_sender
    for backend in (weight_transfer.IN_PROCESS, weight_transfer.GLOO):
        push = weight_push.Push(backend, rank=1, vllm_ranks=2, client=weight_push.NoEngine())
        assert isinstance(push.engine, TrainerWeightTransferEngine) and not push.engine.is_sender
        push.send([("w", torch.zeros(2))])
        push.close()
    with pytest.raises(RuntimeError, match="only trainer rank 0"):
        weight_push.NoEngine().start_weight_update()


def test_ipc_handles_reach_vllms_worker_engine_as_it_reads_them(monkeypatch):
    """The update vLLM's IPC trainer engine sends (one handle per tensor and GPU) goes through vLLM's
    engine-core encoding without a pickle fallback, and vLLM's IPC worker engine parses it back to the same
    handles (with the serialization switch the engine is started with)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    # rebuild_cuda_tensor's arguments hold torch types, which msgpack does not carry
    handles = [{"GPU-0": (torch.Tensor, (2, 3), (3, 1), 0, torch.UntypedStorage, torch.float32, 0, b"h", 24, 0)}]
    update = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 3]], "ipc_handles": handles}
    monkeypatch.setattr("vllm.envs.VLLM_ALLOW_INSECURE_SERIALIZATION", False)
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(update)
    wire = MsgpackDecoder(dict).decode(MsgpackEncoder().encode(weight_push.portable(update)))
    monkeypatch.setattr("vllm.envs.VLLM_ALLOW_INSECURE_SERIALIZATION", True)
    parsed = IPCWeightTransferUpdateInfo(**wire)
    assert parsed.ipc_handles == handles and parsed.names == ["w"]
    gloo = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 3]]}
    assert weight_push.portable(gloo) is gloo

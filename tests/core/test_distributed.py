"""The gathers a push needs, at two real gloo ranks: the full state dict to rank 0 (the CPU transports), or to
every rank on its own device (CUDA IPC, where each rank shares its copy with the vLLM rank on its GPU)."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp


def _rank(rank: int, port: int, model_dir: str) -> None:
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file

    from gspo_core.config import GSPOConfig
    from gspo_core.distributed import Ranks, gather_state_dict, shard
    from gspo_core.policy import load_policy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, _ = load_policy(model_dir, GSPOConfig(), torch.device("cpu"))
        shard(model, torch.device("cpu"), None, Ranks(rank, 2))
        assert any(type(p).__name__ == "DTensor" for p in model.parameters()), "sharded"
        saved = load_file(f"{model_dir}/model.safetensors")
        to_rank_0 = gather_state_dict(model)
        everywhere = gather_state_dict(model, everywhere=True)
        assert (len(to_rank_0) > 0) == (rank == 0), "to rank 0 only"
        assert set(saved) <= set(everywhere)
        for name, tensor in saved.items():
            got = everywhere[name]
            assert type(got) is torch.Tensor and got.shape == tensor.shape and torch.equal(got, tensor), name
    finally:
        dist.destroy_process_group()


def test_the_full_state_reaches_rank_0_or_every_rank(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tiny_model_dir)), nprocs=2)  # raises with a rank's failed assertion

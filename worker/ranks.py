"""A job on several devices: the worker's job process is its rank 0; ranks 1..N-1 are `gspo train` processes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from gspo_core.config import JobSpec
from gspo_core.platform import prepare_job

#: Linux's prctl option that signals a process when its parent dies.
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """A rank whose rank 0 (this worker's job process) died must not wait in a collective for it."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def other_ranks(spec: JobSpec, resume: bool, work: Path) -> Iterator[None]:
    """Start ranks 1..N-1 of the job (N = ``spec.resources.devices``) with torchrun's environment (``env://``
    rendezvous on this machine), and make this process rank 0: it holds the lease, runs the callbacks and
    samples; the others only train their shards. Nothing to start for N = 1. Stopped on exit."""
    world = spec.resources.devices
    if world == 1:
        yield
        return
    rendezvous = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    }
    job = work / "ranks.yaml"
    # The other ranks neither score nor sample: the reward spec (it may hold credentials) stays here.
    job.write_text(yaml.safe_dump({**spec.model_dump(mode="json"), "reward": {}}))
    cmd = [sys.executable, "-m", "gspo_core", "train", str(job), *(["--resume"] if resume else [])]
    ranks = [
        subprocess.Popen(
            cmd,
            env={**os.environ, **rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            preexec_fn=_die_with_parent,
        )
        for rank in range(1, world)
    ]
    os.environ.update({**rendezvous, "RANK": "0", "LOCAL_RANK": "0"})  # read once, by the trainer's join_group
    prepare_job(world)  # rank 0 samples: its vLLM engine runs in processes of its own, over the job's devices
    ended = False
    try:
        yield
        ended = True
    finally:
        for process in ranks:
            try:  # after rank 0's last collective they end; after its failure they would wait for it
                process.wait(timeout=60 if ended else 0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

"""The one launcher of a job on N devices: this process is rank 0; ranks 1..N-1 are `gspo train` processes it starts."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import yaml

from gspo_core.config import JobSpec
from gspo_core.platform import RuntimeOptions, prepare_job

#: Linux's prctl option that signals a process when its parent dies.
PR_SET_PDEATHSIG = 1
#: How long rank 0 waits, once its trainer failed, to learn whether a rank's death caused it: its collective
#: fails the moment the dead rank's sockets close, a little before the watch can reap that rank.
DEATH_GRACE_S = 2.0
#: The job file of ranks 1..N-1, in the launch's work directory.
RANKS_FILE = "ranks.yaml"
#: What a rank's environment holds (``env://`` rendezvous), set by this launcher or by torchrun.
RANK_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether this process is one of a job's N ranks, started by `other_ranks` (rank 0 once it started the
    others) or by torchrun: it joins their process group (`gspo_core.distributed.join_group`)."""
    return all(name in os.environ for name in RANK_ENV)


class RankLost(Exception):
    """A rank other than 0 was killed by a signal (the OOM killer, a lost device or machine), or a collective
    waited out the group's timeout (a rank hung without dying): the attempt is lost, not the job's fault, so
    its owner may retry it from its last checkpoint (the worker does: `worker.runner`)."""


#: How gloo words a collective that waited out the group's timeout: torch 2.13 raises a plain RuntimeError
#: (tests/worker/test_faults.py stops a rank and reads this). NCCL's watchdog ends the process instead, and
#: the worker's lease and reaper retry the attempt.
GLOO_TIMEOUTS = ("Timed out waiting", "Application timeout caused pair closure")


def timed_out(exc: BaseException, timeout_s: int) -> RankLost | None:
    """The attempt lost to a rank that stopped answering, when rank 0's error (or one it came from) is a
    collective's timeout."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RuntimeError) and any(words in str(seen) for words in GLOO_TIMEOUTS):
            return RankLost(f"a rank stopped answering: a collective waited {timeout_s} s (GSPO_RANK_TIMEOUT_S)")
        seen = seen.__cause__ or seen.__context__
    return None


class _Watch(threading.Thread):
    """Polls ranks 1..N-1 while rank 0 trains. When one ends with a non-zero status, it kills the others:
    every connection to rank 0 then closes, so rank 0's next (or current) gloo collective fails at once
    instead of waiting out the group's timeout, and no rank is left waiting for the dead one."""

    def __init__(self, ranks: list[subprocess.Popen]) -> None:
        super().__init__(name="gspo-ranks-watch", daemon=True)
        self.ranks, self.stop = ranks, threading.Event()
        self.ended: tuple[int, int] | None = None  # (rank, exit status; negative: the signal) of the first

    def run(self) -> None:
        while not self.stop.wait(0.1):
            for rank, process in enumerate(self.ranks, 1):
                code = process.poll()
                if code:
                    self.ended = (rank, code)
                    for other in self.ranks:
                        if other.poll() is None:
                            other.kill()
                    return

    def lost(self) -> RankLost | None:
        """After rank 0 failed: the rank killed meanwhile, if any. A rank that exited with an error is not
        one: it failed like rank 0 did (the same bad input) or on its own, and rank 0's error says so."""
        self.join(DEATH_GRACE_S)
        if self.ended is None or self.ended[1] > 0:
            return None
        rank, code = self.ended
        return RankLost(f"rank {rank} was killed ({signal.Signals(-code).name})")


def _die_with_parent() -> None:
    """A rank whose rank 0 died must not wait in a collective for it."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def other_ranks(spec: JobSpec, resume: bool, work: Path, runtime: RuntimeOptions) -> Iterator[None]:
    """Run the body as rank 0 of the job's ``spec.resources.devices`` ranks: start ranks 1..N-1 as `gspo train`
    processes of ``work``/ranks.yaml (the job without its reward spec, which may hold credentials and which
    only rank 0 scores with, and this machine's ``runtime``; ``resume``: from the newest checkpoint in the
    job's output directory) with torchrun's environment (``env://`` rendezvous on this machine), each killed
    by the kernel when this process dies. Nothing to start for N = 1, nor in a process that is already one of
    N ranks (started so, or by torchrun). Stopped on exit: when the body fails, a rank killed meanwhile, or a
    collective that timed out, makes it raise `RankLost`."""
    world = spec.resources.devices
    prepare_job(world)  # rank 0 samples: at N > 1 its vLLM engine runs in processes of its own
    if world == 1 or launched():
        yield
        return
    rendezvous = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    }
    work.mkdir(parents=True, exist_ok=True)
    job = work / RANKS_FILE
    job.write_text(yaml.safe_dump({**spec.model_dump(mode="json"), "reward": {}, "runtime": asdict(runtime)}))
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
    with _watched(ranks, runtime.rank_timeout_s):
        yield


@contextlib.contextmanager
def _watched(ranks: list[subprocess.Popen], timeout_s: int) -> Iterator[None]:
    """Rank 0's body with ranks 1..N-1 watched (`_Watch`), and ended on exit: waited for after the body's last
    collective, killed after its failure (they would wait for it)."""
    watch = _Watch(ranks)
    watch.start()
    ended = False
    try:
        yield
        ended = True
    except Exception as exc:
        lost = watch.lost() or timed_out(exc, timeout_s)
        if lost is not None:
            raise lost from exc
        raise
    finally:
        watch.stop.set()
        for process in ranks:
            try:
                process.wait(timeout=60 if ended else 0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

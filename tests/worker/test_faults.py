"""Infrastructure faults for real: a Redis restart and a PostgreSQL restart in the middle of a job, and a rank of
a 2-device job hung, then killed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from store.models import Checkpoint, JobEvent
from store.objects import get_dir, get_object_store
from tests.core.trainer_support import processes_running
from tests.worker.conftest import build_rig, wait_for

PG_BIN = Path("/usr/lib/postgresql/15/bin") if Path("/usr/lib/postgresql/15/bin").exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on its own port (never the shared one), restartable."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        wait_for(
            lambda: subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).returncode == 0,
            10,
            "redis up",
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class PgCluster:
    """A throwaway PostgreSQL cluster (initdb in tmp, run as the postgres user), restartable."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        root.mkdir(parents=True, exist_ok=True)
        shutil.chown(root, "postgres")
        self._su(f"{PG_BIN}/initdb -D {root}/data -A trust -U postgres")

    def _su(self, cmd: str) -> None:
        subprocess.run(["su", "postgres", "-c", cmd], check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        self._su(
            f"{PG_BIN}/pg_ctl -D {self.root}/data -l {self.root}/log -w start "
            f"-o '-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1'"
        )

    def stop(self) -> None:
        self._su(f"{PG_BIN}/pg_ctl -D {self.root}/data -w stop -m fast")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"


@pytest.fixture()
def redis_server():
    srv = RedisServer()
    srv.start()
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_redis_restart_mid_job(redis_server, pg_database, tmp_path):
    """The running job rides out the restart; the job waiting behind it lost its message (no
    persistence) and the reaper sends it again once the queue is empty."""
    from tests.conftest import truncate_all

    truncate_all(pg_database)
    rig = build_rig(
        tmp_path, pg_database, f"redis://127.0.0.1:{redis_server.port}/0", GSPO_RESEND_LOST_AFTER_SECONDS="3"
    )
    try:
        rig.start_worker()
        job_id = rig.submit(steps=10)
        waiting = rig.submit(steps=2, slow=False)
        wait_for(lambda: len(rig.steps(job_id)) >= 2, 120, "2 steps")
        assert rig.job(waiting)["status"] == "queued"
        redis_server.stop()
        time.sleep(3)
        redis_server.start()
        job = rig.wait_status(job_id, {"succeeded", "failed"}, timeout=150)
        assert job["status"] == "succeeded", rig.logs()
        assert rig.steps(job_id) == list(range(1, 11))
        job = rig.wait_status(waiting, {"succeeded", "failed"}, timeout=120)
        assert job["status"] == "succeeded", rig.logs()
        assert "sent again" in rig.logs()
    finally:
        rig.stop_all()


@pytest.mark.skipif(PG_BIN is None or shutil.which("su") is None, reason="needs PostgreSQL 15 binaries and su")
def test_postgres_restart_mid_job_and_api_503(tmp_path):
    import tempfile

    from tests.conftest import redis_url as suite_redis_url

    pg_root = Path(tempfile.mkdtemp(prefix="gspo-pg-"))  # pytest's tmp dirs are closed to the postgres user
    pg = PgCluster(pg_root)
    pg.start()
    redis_url = suite_redis_url("faults")
    rig = build_rig(tmp_path / "rig", pg.url, redis_url, lease_s=20)
    try:
        rig.start_worker()
        job_id = rig.submit(steps=12)
        wait_for(lambda: len(rig.steps(job_id)) >= 2, 120, "2 steps")
        pg.stop()
        r = rig.client.get(f"/v1/jobs/{job_id}", headers=rig.h)
        assert r.status_code == 503 and "database" in r.json()["error"]["message"]
        assert rig.client.get("/readyz").status_code == 503
        time.sleep(4)
        pg.start()
        wait_for(lambda: rig.client.get(f"/v1/jobs/{job_id}", headers=rig.h).status_code == 200, 30, "API recovers")
        job = rig.wait_status(job_id, {"succeeded", "failed"}, timeout=180)
        assert job["status"] == "succeeded", rig.logs()
        assert rig.steps(job_id) == list(range(1, 13)), "no metric lost while the database was down"
    finally:
        rig.stop_all()
        pg.stop()
        shutil.rmtree(pg_root, ignore_errors=True)


def test_a_lost_rank_retries_the_job_from_its_checkpoint(make_rig, tmp_path):
    """Rank 1 of a 2-device job is lost twice: first stopped (SIGSTOP: it hangs without dying), so rank 0's
    collective waits out the group's timeout; then, on the retry, SIGKILLed (what the OOM killer does), which
    rank 0 notices at its next collective. Each time no rank is left behind and the attempt is lost rather
    than the job: retried from its last checkpoint, it succeeds with each step's metrics once."""
    rig = make_rig(GSPO_WORKER_DEVICES="2", GSPO_MAX_JOB_DEVICES="2", GSPO_RANK_TIMEOUT_S="20")
    rig.start_worker(OMP_NUM_THREADS="1")  # two ranks on two cores
    job_id = rig.submit(steps=6, slow=False, save_every=1, job={"resources": {"devices": 2}})

    def checkpoints() -> list[int]:
        with rig.app.state.db.session() as s:
            return list(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))

    def resumes() -> int:
        with rig.app.state.db.session() as s:
            events = s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id))
            return sum(m.startswith("resumed from step-00000") for m in events)

    ranks = str(tmp_path / "work" / job_id / "ranks.yaml")  # the job file of ranks 1..N-1 (gspo_core/launch.py)
    wait_for(lambda: 1 in checkpoints(), 120, "step 1's checkpoint")
    (hung,) = processes_running(ranks)
    os.kill(hung, signal.SIGSTOP)
    # The retry has resumed and its rank 1 is up (attempt 1 may have saved step 2 before the stop took hold, so a
    # step-2 checkpoint does not say the retry runs).
    wait_for(lambda: resumes() == 1 and processes_running(ranks) not in ([], [hung]), 120, "the retry's resume")
    assert hung not in processes_running(ranks), "the hung rank was ended"
    (rank_1,) = processes_running(ranks)
    os.kill(rank_1, signal.SIGKILL)
    job = rig.wait_status(job_id, {"succeeded", "failed"}, timeout=120)
    assert job["status"] == "succeeded", rig.logs()
    assert rig.steps(job_id) == [1, 2, 3, 4, 5, 6]
    assert rig.db_job(job_id).attempts == 3
    with rig.app.state.db.session() as s:
        events = list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id)))
    assert any(m.startswith("a rank stopped answering: a collective waited 20 s") for m in events), events
    assert any(m.startswith("rank 1 was killed (SIGKILL): this attempt is lost") for m in events), events
    assert resumes() == 2, events
    stored = [key for key, _ in get_object_store(rig.settings).list(f"jobs/{job_id}/checkpoints")]
    assert any(key.endswith("/trainer/__1_0.distcp") for key in stored), "rank 1's shards are stored too"
    assert not processes_running(ranks), "no rank outlives its job"
    assert_ends_as_one_uninterrupted_rank(rig, job_id, tmp_path)


def assert_ends_as_one_uninterrupted_rank(rig, job_id: str, tmp_path: Path) -> None:
    """The retried job's weights are those of the same job run at once in one process (two ranks and one
    agree to rounding: tests/core/test_spmd.py): the resume from the stored sharded state lost and repeated
    nothing."""
    from safetensors.torch import load_file

    from gspo_core.config import GSPOConfig, JobSpec
    from tests.core.trainer_support import one_torch_thread, train

    job = rig.db_job(job_id)
    with rig.app.state.db.session() as s:
        prefix = s.scalar(select(Checkpoint.object_prefix).where(Checkpoint.job_id == job_id, Checkpoint.final))
    final = get_dir(get_object_store(rig.settings), f"{prefix}/model", tmp_path / "final")
    got = load_file(final / "model.safetensors")
    spec = JobSpec(
        model=str(rig.settings.models_dir / "toy"),
        training_file=str(tmp_path / "toy.jsonl"),
        reward=job.reward,
        hyperparameters=GSPOConfig.from_stored({**job.hyperparameters, "seed": job.seed}),
        output_dir=str(tmp_path / "reference"),
    )
    with one_torch_thread():
        want = load_file(Path(train(spec).final_checkpoint) / "model" / "model.safetensors")
    base = load_file(rig.settings.models_dir / "toy" / "model.safetensors")
    assert got.keys() == want.keys()
    moved = max(float((want[name] - base[name]).abs().max()) for name in want)
    err = max(float((got[name] - want[name]).abs().max()) for name in want)
    # Two ranks sum in another order than one: measured 7e-6 after 4 steps here (2e-6 after 3 in test_spmd).
    assert moved > 1e-3 and err < 5e-5, (moved, err)

"""Infrastructure faults for real: a Redis restart and a PostgreSQL restart in the middle of a job."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

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

    from tests.conftest import REDIS_URL

    pg_root = Path(tempfile.mkdtemp(prefix="gspo-pg-"))  # pytest's tmp dirs are closed to the postgres user
    pg = PgCluster(pg_root)
    pg.start()
    redis_url = REDIS_URL.rsplit("/", 1)[0] + "/12"
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

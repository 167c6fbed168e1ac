"""Worker test rig: a fresh PostgreSQL database, a Redis db, real `celery worker` subprocesses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import select

from gspo_core.toy import TOY_REWARD, build_tiny_model, write_toy_dataset
from store.models import Job, StepMetric
from store.settings import Settings
from store.tenants import create_tenant_and_key
from tests.conftest import redis_url as suite_redis_url
from tests.conftest import spawn_logged, truncate_all

ROOT = Path(__file__).resolve().parents[2]
SLOW_GRADER = {
    "type": "python",
    "source": "import time\ndef grade(sample, item):\n    time.sleep(0.03)\n    return 0.0",
}


def wait_for(pred, timeout: float, what: str, every: float = 0.2):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Rig:
    """Settings + env for workers, an in-process API client, and helpers to read the job's state."""

    def __init__(self, settings: Settings, env: dict, tmp: Path) -> None:
        from api.app import create_app

        self.settings, self.env, self.tmp = settings, env, tmp
        self.app = create_app(settings)
        self.client = TestClient(self.app)
        with self.app.state.db.session() as s:
            _, key = create_tenant_and_key(s, f"t-{uuid.uuid4().hex[:6]}")
        self.h = {"Authorization": f"Bearer {key}"}
        self.workers: list[subprocess.Popen] = []
        build_tiny_model(settings.models_dir / "toy")
        self.data = write_toy_dataset(tmp / "toy.jsonl", n=32).read_bytes()
        self.file_id = self.upload(self.h)

    def upload(self, headers: dict) -> str:
        return self.client.post("/v1/files", files={"file": ("t.jsonl", self.data)}, headers=headers).json()["id"]

    def add_tenant(self) -> tuple[dict, str]:
        """Another tenant: its auth headers and its own copy of the toy file."""
        with self.app.state.db.session() as s:
            _, key = create_tenant_and_key(s, f"t-{uuid.uuid4().hex[:6]}")
        h = {"Authorization": f"Bearer {key}"}
        return h, self.upload(h)

    def start_worker(self, **env: str) -> subprocess.Popen:
        """`gspo worker`'s exact Celery command, in its own process group (the pool child included); ``env``:
        settings of this worker alone."""
        from gspo_cli.service_cmd import worker_command

        log = self.tmp / f"worker-{len(self.workers)}.log"
        cmd = worker_command(
            "INFO", name=f"w{len(self.workers)}-{uuid.uuid4().hex[:4]}@%h", queue=self.settings.worker_queue
        )
        proc = spawn_logged(cmd, log, env={**self.env, **env}, cwd=ROOT, start_new_session=True)
        self.workers.append(proc)
        return proc

    def kill_worker(self, proc: subprocess.Popen) -> None:
        """What a lost machine or an OOM-killed container does: SIGKILL to every process of the worker."""
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def submit(
        self, steps: int, slow: bool = True, tenant: tuple[dict, str] | None = None, job: dict | None = None, **hp
    ) -> str:
        """A job of the rig's tenant (or of ``tenant`` from `add_tenant`); ``job``: more body fields."""
        headers, file_id = tenant or (self.h, self.file_id)
        reward = (
            {
                "type": "multi",
                "graders": {"match": TOY_REWARD, "slow": SLOW_GRADER},
                "calculate_output": "match + 0*slow",
            }
            if slow
            else TOY_REWARD
        )
        body = {
            "model": "toy",
            "training_file": file_id,
            "reward": reward,
            **(job or {}),
            "hyperparameters": {
                "steps": steps,
                "prompts_per_step": 2,
                "group_size": 8,
                "max_new_tokens": 4,
                "learning_rate": 3e-3,
                **hp,
            },
        }
        r = self.client.post("/v1/jobs", json=body, headers=headers)
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def job(self, job_id: str, headers: dict | None = None) -> dict:
        return self.client.get(f"/v1/jobs/{job_id}", headers=headers or self.h).json()

    def steps(self, job_id: str) -> list[int]:
        with self.app.state.db.session() as s:
            return list(s.scalars(select(StepMetric.step).where(StepMetric.job_id == job_id).order_by(StepMetric.step)))

    def db_job(self, job_id: str) -> Job:
        with self.app.state.db.session() as s:
            return s.get(Job, job_id)

    def wait_status(self, job_id: str, statuses: set[str], timeout: float = 120, headers: dict | None = None) -> dict:
        return wait_for(
            lambda: (j := self.job(job_id, headers))["status"] in statuses and j, timeout, f"{job_id} in {statuses}"
        )

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in sorted(self.tmp.glob("worker-*.log")))

    def stop_all(self) -> None:
        for p in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        self.client.close()
        self.app.state.db.dispose()
        if self.settings.redis_url:
            q = self.settings.worker_queue
            with contextlib.suppress(redis.ConnectionError):
                redis.Redis.from_url(self.settings.redis_url).delete(
                    q, f"_kombu.binding.{q}", f"_kombu.binding_permanent.{q}"
                )


def build_rig(tmp_path: Path, db_url: str, redis_url: str, lease_s: float = 6, **extra_env: str) -> Rig:
    from store.db import run_migrations

    run_migrations(db_url)
    env_vals = {
        "GSPO_DATA_DIR": str(tmp_path),
        "DATABASE_URL": db_url,
        "REDIS_URL": redis_url,
        "GSPO_MODELS_DIR": str(tmp_path / "models"),
        "GSPO_LEASE_SECONDS": str(lease_s),
        "GSPO_HEARTBEAT_SECONDS": "1",
        "GSPO_REAPER_INTERVAL_SECONDS": "1",
        "GSPO_MAX_ATTEMPTS": "3",
        "GSPO_ROLLOUT_ENGINE": "transformers",  # the operator's setting (vLLM's start costs seconds a job)
        # A queue of its own: suites running at the same time on the same Redis never share messages.
        "GSPO_WORKER_QUEUE": f"gpu-{uuid.uuid4().hex[:8]}",
        **extra_env,
    }
    settings = Settings(**{k.removeprefix("GSPO_").lower(): v for k, v in env_vals.items()})
    env = {**os.environ, **env_vals, "PYTHONPATH": str(ROOT)}
    return Rig(settings, env, tmp_path)


@pytest.fixture()
def make_rig(pg_database, tmp_path):
    """``make_rig(**env)``: a rig whose Settings (API and workers) take ``env``; stopped at the end."""
    truncate_all(pg_database)
    redis_url = suite_redis_url("rigs")
    try:
        redis.Redis.from_url(redis_url).ping()
    except redis.ConnectionError as exc:
        pytest.skip(f"Redis not reachable: {exc}")
    rigs = []

    def make(**env: str):
        rigs.append(build_rig(tmp_path, pg_database, redis_url, **env))
        return rigs[-1]

    yield make
    for r in rigs:
        r.stop_all()


@pytest.fixture()
def rig(make_rig):
    return make_rig()

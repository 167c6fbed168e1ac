"""`gspo up`: one command starts API + worker + dashboard on the embedded default, and stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from sqlalchemy import select

from gspo_core.toy import TOY_REWARD, build_tiny_model, write_toy_dataset
from tests.conftest import spawn_logged
from tests.worker.conftest import ROOT, wait_for

# Its own lines only: no library's INFO, and no error at the worker's stop (tests/cli/test_quiet_run.py).
NOISE = re.compile(r"\b(ERROR|CRITICAL|INFO)\b|Traceback")


def start_up(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str, str, Path]:
    """`gspo up` on a free port, ready: its process, URL, API key and output file."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GSPO_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)}
    for name in ("DATABASE_URL", "REDIS_URL", "GSPO_LOG_LEVEL", "LOG_LEVEL"):
        env.pop(name, None)
    log = tmp_path / "up.log"
    proc = spawn_logged(
        [sys.executable, "-m", "gspo_cli.main", "up", "--port", str(port), *args], log, env=env, cwd=tmp_path
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _ok(url + "/readyz"), 60, "gspo up ready")
    key = re.search(r"API key for tenant 'default': (\S+)", log.read_text()).group(1)
    return proc, url, key, log


def test_gspo_up_serves_api_dashboard_and_worker_and_stopping_it_mid_job_checkpoints_and_requeues(tmp_path):
    """One `gspo up` (a start costs seconds): it serves the API, the dashboard and a worker on the embedded
    default, says which sandbox python graders get, and restarts its worker when it is killed (/readyz says
    it is missing meanwhile); stopped mid-job, the embedded worker's warm shutdown reaches the running job
    (its pool differs from Redis's, whose case tests/worker/test_worker.py covers): the job checkpoints and is
    queued again, no worker is left behind, and nothing errs. Its key is the one it prints at the next start."""
    from gspo_client import Client

    build_tiny_model(tmp_path / "data" / "models" / "toy")
    proc, url, key, log = start_up(tmp_path, "--rollout-engine", "transformers")
    try:
        assert httpx.get(url + "/v1/jobs", headers={"Authorization": f"Bearer {key}"}).json()["data"] == []
        assert "GSPO jobs" in httpx.get(url + "/").text
        assert "python graders: bubblewrap isolation" in log.read_text()
        assert (tmp_path / "data" / "gspo.db").exists()
        wait_for(lambda: _ready(url)["worker"] == "ok", 90, "the worker's first beat")
        worker = _worker(proc)
        os.kill(worker.pid, signal.SIGKILL)
        wait_for(lambda: _ready(url)["worker"] == "missing", 10, "/readyz reporting the killed worker", every=0.05)
        wait_for(lambda: _ready(url)["worker"] == "ok", 90, "the worker restarted")
        assert _worker(proc).pid != worker.pid
        children = psutil.Process(proc.pid).children(recursive=True)
        with Client(url, key) as client:
            f = client.upload_file(write_toy_dataset(tmp_path / "toy.jsonl", n=32))
            hp = {"steps": 200, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4, "save_every": 1000}
            job_id = client.create_job(model="toy", training_file=f["id"], reward=TOY_REWARD, hyperparameters=hp)["id"]
            wait_for(lambda: (client.get_job(job_id)["step"] or 0) >= 2, 120, "2 steps")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "no orphaned worker"
    out = log.read_text()
    assert "asked the running job to checkpoint and requeue" in out, out
    assert not NOISE.search(out), out
    assert "worker: Warm shutdown (MainProcess)" not in out, out  # Celery prints it to stdout at any level
    from store.db import Database
    from store.models import Job, JobEvent
    from store.settings import Settings

    db = Database(Settings(data_dir=tmp_path / "data").resolved_database_url())
    with db.session() as s:
        job = s.get(Job, job_id)
        messages = list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id)))
    db.dispose()
    assert job.status == "queued" and job.attempts == 0, (job.status, job.attempts, messages)
    assert "worker shutting down: checkpointed and requeued" in messages, messages
    # The next start prints the same key (none is minted per start), and a new one once it is revoked.
    assert _up_key(tmp_path) == key
    from store.tenants import revoke_key

    with db.session() as s:
        assert revoke_key(s, key)
    db.dispose()
    assert _up_key(tmp_path) not in (key, "")


def _up_key(tmp_path: Path) -> str:
    code = "from gspo_cli.service_cmd import up_key; print(up_key('default'))"
    env = {**os.environ, "GSPO_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)}
    env.pop("DATABASE_URL", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _worker(proc: subprocess.Popen) -> psutil.Process:
    """The worker's main process (a child of `gspo up`)."""
    workers = [c for c in psutil.Process(proc.pid).children() if "celery" in " ".join(c.cmdline())]
    assert len(workers) == 1, workers
    return workers[0]


def _ready(url: str) -> dict:
    return httpx.get(url + "/readyz", timeout=10).json()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False

"""An API process killed while it stores an upload leaves a ``.part`` file; the next API start removes it
(its writer's lock died with it), and leaves a write that another process still holds."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from api.app import create_app
from store.db import Database, run_migrations
from store.objects import PART_GRACE_S
from store.settings import Settings
from store.tenants import create_tenant_and_key
from tests.worker.conftest import ROOT, wait_for

ROW_BYTES = 2 * 1024 * 1024
ROWS = 24  # ~48 MiB: copying it into the object store takes long enough to be caught midway


def _start_api(env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "gspo_cli.main", "api", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, "API up", every=0.1)
    return proc, url


def _upload(url: str, key: str, body: bytes, done: threading.Event) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the server dies under it
        httpx.post(
            url + "/v1/files",
            files={"file": ("big.jsonl", body)},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
    done.set()


def _kill_mid_copy(env: dict, log: Path, key: str, body: bytes, objects: Path) -> Path:
    """Upload ``body`` and SIGKILL the API the moment its ``.part`` appears; retried when the copy was too
    quick to be caught. The ``.part`` left behind."""
    for _ in range(5):
        proc, url = _start_api(env, log)
        done = threading.Event()
        threading.Thread(target=_upload, args=(url, key, body, done), daemon=True).start()
        while not done.is_set():
            parts = list(objects.rglob("*.part")) if objects.exists() else []
            if parts:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
                if parts[0].exists():
                    return parts[0]
                break
            time.sleep(0.0005)
        proc.kill()
        proc.wait(10)
    raise AssertionError("the upload's copy was never caught midway")


def test_a_crash_mid_upload_leaves_no_part_after_the_next_start(tmp_path):
    settings = Settings(data_dir=tmp_path, models_dir=tmp_path / "models")
    run_migrations(settings.resolved_database_url())
    db = Database(settings.resolved_database_url())
    with db.session() as s:
        _, key = create_tenant_and_key(s, f"crash-{uuid.uuid4().hex[:6]}")
    db.dispose()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GSPO_")},
        "GSPO_DATA_DIR": str(tmp_path),
        "GSPO_MODELS_DIR": str(tmp_path / "models"),
        "GSPO_MAX_UPLOAD_BYTES": str(ROWS * (ROW_BYTES + 64)),
        "GSPO_MAX_ROW_BYTES": str(ROW_BYTES + 64),
        "GSPO_UPLOAD_BYTES_PER_SECOND": "0",
        "PYTHONPATH": str(ROOT),
    }
    row = b'{"prompt": "' + b"x" * ROW_BYTES + b'"}\n'
    objects, log = tmp_path / "objects", tmp_path / "api.log"
    crashed = _kill_mid_copy(env, log, key, row * ROWS, objects)
    assert crashed.stat().st_size < len(row) * ROWS

    # Another process's upload in progress: its lock held, however old its file.
    live = crashed.with_name("file_live.jsonl.part")
    live.write_bytes(b"{}\n")
    old = time.time() - 3600
    os.utime(live, (old, old))
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        time.sleep(max(0.0, crashed.stat().st_mtime + PART_GRACE_S + 0.1 - time.time()))
        # The next start (in this process: what runs at start is the same, and it starts faster).
        app = create_app(Settings(data_dir=tmp_path, models_dir=tmp_path / "models"))
        try:
            with TestClient(app) as client:
                wait_for(lambda: not crashed.exists(), 30, "the crashed upload's .part removed", every=0.05)
                assert live.exists()
                files = client.get("/v1/files", headers={"Authorization": f"Bearer {key}"}).json()["data"]
                assert files == []  # nothing half-written: no row, no stored object
                assert [p.name for p in objects.rglob("*") if p.is_file()] == [live.name]
        finally:
            app.state.db.dispose()

"""`gspo up`: one command starts API + worker + dashboard on the embedded default, and stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time

import httpx
import psutil

from tests.conftest import spawn_logged
from tests.worker.conftest import ROOT, wait_for


def test_gspo_up_serves_api_dashboard_and_worker(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GSPO_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)}
    env.pop("DATABASE_URL", None), env.pop("REDIS_URL", None)
    log = tmp_path / "up.log"
    proc = spawn_logged([sys.executable, "-m", "gspo_cli.main", "up", "--port", str(port)], log, env=env, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ok(url + "/readyz"), 60, "gspo up ready")
        key = re.search(r"API key for tenant 'default': (\S+)", log.read_text()).group(1)
        assert httpx.get(url + "/v1/jobs", headers={"Authorization": f"Bearer {key}"}).json()["data"] == []
        assert "GSPO jobs" in httpx.get(url + "/").text
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("celery" in " ".join(c.cmdline()) for c in children), "the worker runs"
        assert (tmp_path / "data" / "gspo.db").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "no orphaned worker"


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False

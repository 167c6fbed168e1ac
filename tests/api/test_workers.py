"""`gspo api --workers 2`: several server processes answer as one (metrics summed, keys revoked at once)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from tests.conftest import run_gspo
from tests.e2e.test_service_e2e import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _requests_counted(url: str, route: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", headers={"Authorization": "Bearer scrape"}).text.splitlines():
        if line.startswith("gspo_http_requests_total{") and f'route="{route}"' in line and 'status="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_server_processes_share_metrics_and_revocation(tmp_path):
    env = {
        **os.environ,
        "GSPO_DATA_DIR": str(tmp_path / "data"),
        "GSPO_MODELS_DIR": str(tmp_path / "models"),
        "GSPO_METRICS_TOKEN": "scrape",
    }
    env.pop("DATABASE_URL", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    run_gspo(env, "migrate")
    key = run_gspo(env, "admin", "create-key", "--tenant", "w").splitlines()[-1]
    port = free_port()
    api = subprocess.Popen(
        [sys.executable, "-m", "gspo_cli.main", "api", "--host", "127.0.0.1", "--port", str(port), "--workers", "2"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and api.poll() is None, "API with 2 workers did not start"
            time.sleep(0.2)
        h = {"Authorization": f"Bearer {key}", "Connection": "close"}  # a new connection may reach either process
        for _ in range(30):
            assert httpx.get(url + "/v1/files", headers=h).status_code == 200
        assert _requests_counted(url, "/v1/files") == 30  # whichever process answers the scrape sums all
        run_gspo(env, "admin", "revoke-key", key)
        assert all(httpx.get(url + "/v1/files", headers=h).status_code == 401 for _ in range(10))
    finally:
        api.terminate()
        api.wait(20)

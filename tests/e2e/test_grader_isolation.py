"""A real uvicorn API keeps answering while a dry run grades samples that never yield: the graders run
in the killable pool, not on the server's GIL; the samples score 0 with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx

from tests.conftest import run_gspo, spawn_logged
from tests.e2e.test_service_e2e import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 3.0  # GSPO_GRADER_LOCAL_TIMEOUT_S of the server under test


def test_healthz_answers_during_a_dry_run_of_graders_that_never_yield(tmp_path):
    env = {
        **os.environ,
        "GSPO_DATA_DIR": str(tmp_path / "data"),
        "GSPO_MODELS_DIR": str(tmp_path / "models"),
        "GSPO_GRADER_LOCAL_TIMEOUT_S": str(TIMEOUT_S),
        "PYTHONPATH": ROOT,
    }
    env.pop("DATABASE_URL", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    run_gspo(env, "migrate")
    key = run_gspo(env, "admin", "create-key", "--tenant", "iso").splitlines()[-1]
    port = free_port()
    api = spawn_logged(
        [sys.executable, "-m", "gspo_cli.main", "api", "--host", "127.0.0.1", "--port", str(port)],
        tmp_path / "api.log",
        env=env,
        cwd=ROOT,
    )
    url, h = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
    spec = {
        "type": "multi",
        "graders": {
            "math": {"type": "math_answer", "reference": "{{item.answer}}"},
            "schema": {"type": "json_schema", "schema": {"type": "string", "pattern": "^(a+)+$"}},
        },
    }
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and api.poll() is None, (tmp_path / "api.log").read_text()
            time.sleep(0.2)
        warm = httpx.post(
            url + "/v1/rewards/run",
            headers=h,
            timeout=120,
            json={"reward": spec, "item": {"answer": "2"}, "samples": ["\\boxed{2}"]},
        )
        assert warm.status_code == 200 and warm.json()["results"][0]["scores"]["math"] == 1.0, warm.text
        answer: dict = {}

        def dry_run() -> None:
            t0 = time.monotonic()
            r = httpx.post(
                url + "/v1/rewards/run",
                headers=h,
                timeout=120,
                json={
                    "reward": spec,
                    "item": {"answer": "1"},
                    "samples": ["\\boxed{(x+1)^{99999}}", '"' + "a" * 40 + '!"', "\\boxed{1}"],
                },
            )
            answer.update(status=r.status_code, body=r.json(), elapsed=time.monotonic() - t0)

        worker = threading.Thread(target=dry_run)
        worker.start()
        latencies = []
        while worker.is_alive():
            t0 = time.monotonic()
            assert httpx.get(url + "/healthz", timeout=10).status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)
        worker.join()
        assert answer["status"] == 200, answer
        res = answer["body"]["results"]
        assert res[0]["errors"]["math"].startswith("timeout") and res[0]["scores"]["math"] == 0.0
        assert res[1]["errors"]["schema"].startswith("timeout") and res[1]["scores"]["schema"] == 0.0
        assert res[2]["scores"]["math"] == 1.0 and not res[2]["errors"]
        assert answer["elapsed"] < 2 * (TIMEOUT_S + 1) + 10, answer["elapsed"]
        assert len(latencies) >= 5 and max(latencies) < 1.0, latencies  # a GIL held by re/sympy: seconds
    finally:
        api.terminate()
        try:
            api.wait(20)
        except subprocess.TimeoutExpired:  # a server stuck in a grader does not stop on SIGTERM
            api.kill()
            api.wait()

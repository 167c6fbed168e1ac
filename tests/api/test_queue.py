"""Queue limits over the API: the active-jobs cap under concurrent HTTP submissions, the wall-clock
limit a job asks for, what a queued job says about its wait, and GET /v1/usage."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.api.conftest import job_body


@pytest.fixture()
def live_url(app):
    """The app behind a real uvicorn server on a free loopback port (requests truly run concurrently)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    th.join(10)


def test_concurrent_submissions_get_exactly_the_cap(live_url, settings, auth, other_auth, uploaded, model_name):
    cap = settings.max_active_jobs_per_tenant
    barrier, codes, bodies = threading.Barrier(12), [], []

    def submit() -> None:
        with httpx.Client(base_url=live_url, headers=auth, timeout=60) as c:
            barrier.wait()
            r = c.post("/v1/jobs", json=job_body(uploaded["id"]))
            codes.append(r.status_code)
            bodies.append(r.json())

    threads = [threading.Thread(target=submit) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(codes) == [201] * cap + [429] * (12 - cap), bodies
    refused = [b["error"] for b in bodies if isinstance(b.get("error"), dict)]
    assert len(refused) == 12 - cap and all(
        e["type"] == "too_many_jobs" and f"at most {cap} queued or running" in e["message"] for e in refused
    )
    jobs = httpx.get(f"{live_url}/v1/jobs", headers=auth).json()["data"]
    assert len(jobs) == cap and sorted(j["queue_position"] for j in jobs) == list(range(1, cap + 1))


def test_a_job_may_ask_for_less_device_time_than_the_operator_allows(client, settings, auth, uploaded, model_name):
    limit = int(settings.max_job_wall_seconds)
    r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "max_wall_seconds": limit + 1}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["field"] == "max_wall_seconds", r.text
    assert str(limit) in r.json()["error"]["message"]
    r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "max_wall_seconds": 0}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["field"] == "max_wall_seconds"
    r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "max_wall_seconds": 90}, headers=auth)
    assert r.status_code == 201 and r.json()["max_wall_seconds"] == 90
    assert r.json()["usage"] == {"device_seconds": 0.0, "tokens_sampled": 0, "tokens_trained": 0}


def test_a_queued_job_tells_only_its_own_tenants_queue(client, auth, other_auth, uploaded, toy_dataset, model_name):
    mine = [client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json() for _ in range(3)]
    theirs_file = client.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=other_auth).json()
    theirs = client.post("/v1/jobs", json=job_body(theirs_file["id"]), headers=other_auth).json()
    assert theirs["queue_position"] == 1 and theirs["waiting_reason"] == "waiting for a free worker", theirs
    got = [client.get(f"/v1/jobs/{j['id']}", headers=auth).json() for j in mine]
    assert [(j["queue_position"], j["waiting_reason"]) for j in got] == [
        (1, "waiting for a free worker"),
        (2, "queued: 1 of your jobs ahead"),
        (3, "queued: 2 of your jobs ahead"),
    ]
    cancelled = client.post(f"/v1/jobs/{mine[0]['id']}/cancel", headers=auth).json()
    assert cancelled["queue_position"] is None and cancelled["waiting_reason"] is None
    listed = client.get("/v1/jobs", headers=auth).json()["data"]
    assert [(j["queue_position"], j["waiting_reason"]) for j in listed] == [
        (2, "queued: 1 of your jobs ahead"),
        (1, "waiting for a free worker"),
        (None, None),
    ]


def test_usage_of_a_tenant_with_nothing_run(client, settings, auth):
    r = client.get("/v1/usage", headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["period_seconds"] == settings.budget_period_seconds and body["budget_device_hours"] is None
    assert body["current"]["device_seconds"] == 0 and body["periods"] == [] and body["total"]["jobs"] == 0
    assert body["budget_left_device_hours"] is None and body["budget_exhausted_until"] is None
    assert client.get("/v1/usage?periods=0", headers=auth).status_code == 422

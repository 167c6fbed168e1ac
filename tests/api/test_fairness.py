"""Per-tenant bounds on a real server: event streams, dry runs and uploads answer 429 with Retry-After
past their caps (in-process limiter and Redis limiter), and an idle stream holds no pooled connection."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import httpx
import pytest

from store import jobs, progress
from store.models import File
from store.settings import Settings
from store.tenants import create_tenant_and_key
from tests.api.live import LiveServer
from tests.conftest import redis_url

SLOW_GRADER = {
    "type": "python",
    "name": "slow",
    "timeout_s": 10,
    "source": "import time\ndef grade(sample, item):\n    time.sleep(2.5)\n    return 1.0",
}


def _limited(settings: Settings, limiter: str) -> Settings:
    """Small caps; the limiter in this process or in Redis (a fresh key space per test: new tenants)."""
    return settings.model_copy(
        update={
            "redis_url": redis_url("api") if limiter == "redis" else None,
            "worker_queue": f"q-{uuid.uuid4().hex[:8]}",
            "max_streams_per_tenant": 2,
            "stream_poll_seconds": 30.0,
            "max_reward_runs_per_tenant": 1,
            "max_uploads_per_tenant": 1,
        }
    )


@pytest.fixture(params=["process", "redis"])
def limited(request, settings) -> Settings:
    """On SQLite and PostgreSQL (the `settings` fixture's databases)."""
    return _limited(settings, request.param)


@pytest.fixture(params=["process", "redis"])
def limited_sqlite(request, tmp_path) -> Settings:
    """For bounds that do not touch the database beyond a lookup: SQLite only."""
    from store.db import run_migrations

    url = f"sqlite:///{tmp_path / 'gspo.db'}"
    run_migrations(url)
    return _limited(Settings(data_dir=tmp_path, database_url=url, models_dir=tmp_path / "models"), request.param)


def _tenant_with_job(app, name: str) -> tuple[dict, str]:
    """A new tenant's auth header and a queued job of it (rows as the API writes them)."""
    with app.state.db.session() as s:
        tenant, key = create_tenant_and_key(s, f"{name}-{uuid.uuid4().hex[:6]}")
        f = File(
            tenant_id=tenant.id,
            filename="t.jsonl",
            bytes=1,
            rows=1,
            object_key=f"tenants/{tenant.id}/files/x",
            item_fields=["prompt"],
        )
        s.add(f)
        s.flush()
        job = jobs.create_job(
            s, tenant_id=tenant.id, model="org/m", training_file_id=f.id, reward={}, hyperparameters={}, total_steps=1
        )
        return {"Authorization": f"Bearer {key}"}, job.id


@contextlib.contextmanager
def _open_stream(http: httpx.Client, job_id: str, auth: dict, base: str = ""):
    """An event stream, held open once its first poll is done (the keep-alive that follows it)."""
    with http.stream("GET", f"{base}/v1/jobs/{job_id}/events", headers=auth) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: dropping the iterator would close the response
        while next(lines) != ": keep-alive":
            pass
        yield r


def _assert_429(r: httpx.Response, kind: str = "too_many_requests") -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == kind and int(r.headers["Retry-After"]) >= 1


def test_streams_capped_per_tenant_and_idle_streams_hold_no_connection(limited, request):
    from api.app import create_app

    app = create_app(limited)
    a, job_a = _tenant_with_job(app, "a")
    b, job_b = _tenant_with_job(app, "b")
    try:
        with (
            LiveServer(app) as live,
            httpx.Client(base_url=live.url, timeout=20) as http,
            _open_stream(http, job_a, a),
            _open_stream(http, job_a, a) as second,
        ):
            _assert_429(http.get(f"/v1/jobs/{job_a}/events", headers=a))
            with _open_stream(http, job_b, b):  # another tenant's cap is its own
                # Three streams wait between polls: none holds a pooled connection.
                assert app.state.db.engine.pool.checkedout() == 0
                assert http.get("/v1/jobs", headers=b).status_code == 200
            second.close()
            deadline = time.monotonic() + 10  # the server sees the disconnect and frees the slot
            while True:
                with http.stream("GET", f"/v1/jobs/{job_a}/events", headers=a) as r:
                    if r.status_code == 200:
                        break
                    assert r.status_code == 429 and time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        app.state.db.dispose()


def test_stream_cap_is_shared_by_server_processes_through_redis(settings):
    """Two app instances (as `gspo api --workers 2` runs them) share nothing but Redis: a tenant's
    cap holds across them."""
    from api.app import create_app

    shared = settings.model_copy(
        update={"redis_url": redis_url("api"), "max_streams_per_tenant": 1, "stream_poll_seconds": 30.0}
    )
    one, two = create_app(shared), create_app(shared)
    a, job_a = _tenant_with_job(one, "a")
    try:
        with (
            LiveServer(one) as s1,
            LiveServer(two) as s2,
            httpx.Client(timeout=20) as http,
            _open_stream(http, job_a, a, s1.url),
        ):
            _assert_429(http.get(f"{s2.url}/v1/jobs/{job_a}/events", headers=a))
    finally:
        one.state.db.dispose()
        two.state.db.dispose()


def test_dry_runs_capped_per_tenant_and_budgeted(limited_sqlite):
    from api.app import create_app

    app = create_app(
        limited_sqlite.model_copy(
            update={"reward_run_budget_s": 2.0, "reward_run_window_s": 1e6, "max_reward_runs_per_process": 2}
        )
    )
    a, _ = _tenant_with_job(app, "a")
    b, _ = _tenant_with_job(app, "b")
    body = {"reward": SLOW_GRADER, "samples": ["x"]}
    try:
        with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
            first: list[httpx.Response] = []
            t = threading.Thread(target=lambda: first.append(http.post("/v1/rewards/run", json=body, headers=a)))
            t.start()
            time.sleep(1.0)  # the first run is grading
            _assert_429(http.post("/v1/rewards/run", json=body, headers=a))
            started = time.monotonic()
            assert http.get("/healthz").status_code == 200 and time.monotonic() - started < 1.0
            other = http.post("/v1/rewards/run", json={"reward": SLOW_GRADER, "samples": ["y"]}, headers=b)
            assert other.status_code == 200, other.text  # tenant b has its own slot
            t.join(30)
            assert first[0].status_code == 200 and first[0].json()["results"][0]["reward"] == 1.0
            # The first run used its 2 s budget of grading time: more waits for the window's end.
            _assert_429(http.post("/v1/rewards/run", json=body, headers=a), "budget_exhausted")
    finally:
        app.state.db.dispose()


def test_dry_runs_capped_per_process(limited_sqlite):
    from api.app import create_app

    app = create_app(limited_sqlite.model_copy(update={"max_reward_runs_per_process": 1}))
    a, _ = _tenant_with_job(app, "a")
    b, _ = _tenant_with_job(app, "b")
    try:
        with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
            done: list[httpx.Response] = []
            t = threading.Thread(
                target=lambda: done.append(
                    http.post("/v1/rewards/run", json={"reward": SLOW_GRADER, "samples": ["x"]}, headers=a)
                )
            )
            t.start()
            time.sleep(1.0)
            busy = http.post("/v1/rewards/run", json={"reward": SLOW_GRADER, "samples": ["x"]}, headers=b)
            assert (
                busy.status_code == 503
                and busy.json()["error"]["type"] == "server_busy"
                and busy.headers["Retry-After"]
            )
            t.join(30)
            assert done[0].status_code == 200, done[0].text
            r = http.post(
                "/v1/rewards/run", json={"reward": {"type": "length", "target": 1}, "samples": ["x"]}, headers=b
            )
            assert r.status_code == 200, r.text  # the slot was given back
    finally:
        app.state.db.dispose()


def test_uploads_capped_per_tenant(limited_sqlite):
    from api.app import create_app

    app = create_app(limited_sqlite)
    a, _ = _tenant_with_job(app, "a")
    boundary = "gspoboundary"
    release = threading.Event()

    def slow_body():
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        yield b'{"prompt": "a"}\n'
        release.wait(20)  # the upload is still arriving
        yield f"\r\n--{boundary}--\r\n".encode()

    try:
        with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
            first: list[httpx.Response] = []
            t = threading.Thread(
                target=lambda: first.append(
                    http.post(
                        "/v1/files",
                        content=slow_body(),
                        headers={**a, "Content-Type": f"multipart/form-data; boundary={boundary}"},
                    )
                )
            )
            t.start()
            time.sleep(0.7)
            _assert_429(http.post("/v1/files", files={"file": ("b.jsonl", b'{"prompt": "b"}\n')}, headers=a))
            release.set()
            t.join(30)
            assert first[0].status_code == 201, first[0].text
            assert (
                http.post("/v1/files", files={"file": ("b.jsonl", b'{"prompt": "b"}\n')}, headers=a).status_code == 201
            )
    finally:
        app.state.db.dispose()


def test_streams_end_after_their_maximum_and_the_client_resumes(settings):
    """Each stream lasts at most GSPO_STREAM_MAX_SECONDS; gspo_client resumes with Last-Event-ID and
    sees every step once."""
    from api.app import create_app
    from gspo_client import Client
    from store.models import Job

    app = create_app(settings.model_copy(update={"stream_max_seconds": 0.5, "stream_poll_seconds": 0.1}))
    a, job_id = _tenant_with_job(app, "a")

    def work() -> None:
        with app.state.db.session() as s:
            jobs.claim(s, job_id, "w", 30)
        for step in range(1, 7):
            time.sleep(0.3)
            with app.state.db.session() as s:
                progress.record_step(s, job_id, step, {"loss": float(step)})
        with app.state.db.session() as s:
            jobs.transition(s, s.get(Job, job_id), "succeeded")

    try:
        with LiveServer(app) as live, Client(live.url, a["Authorization"].split()[1]) as client:
            t = threading.Thread(target=work)
            t.start()
            seen = list(client.events(job_id))
            t.join()
        assert [d["step"] for e, d, _ in seen if e == "metrics"] == [1, 2, 3, 4, 5, 6]
        assert seen[-1][0] == "end" and seen[-1][1]["status"] == "succeeded"
    finally:
        app.state.db.dispose()


def test_api_process_gil_switch_interval_is_the_operators_while_it_serves(settings):
    """The event loop waits at most the switch interval behind a busy thread: the API sets the operator's
    value for as long as it serves, and gives the process its own back afterwards. What was loaded is kept
    out of the cyclic GC's passes, also by an app that starts after other code unfroze the heap (an in-process
    vLLM engine does at its shutdown)."""
    import gc
    import sys

    from fastapi.testclient import TestClient

    from api.app import create_app

    before = sys.getswitchinterval()
    for _ in range(2):
        gc.unfreeze()
        app = create_app(settings.model_copy(update={"api_switch_interval_ms": 2.0}))
        try:
            with TestClient(app) as client:
                assert client.get("/healthz").status_code == 200
                assert sys.getswitchinterval() == pytest.approx(0.002)
                assert gc.get_freeze_count() > 0
            assert sys.getswitchinterval() == before
        finally:
            app.state.db.dispose()


def test_an_upload_is_read_at_the_operators_rate(settings):
    """GSPO_UPLOAD_BYTES_PER_SECOND: the body is read no faster (the client is held back), so a tenant's
    uploads cost the event loop a bounded share; other requests are not slowed by it."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from store.tenants import create_tenant_and_key

    rows = b"".join(b'{"prompt": "%s", "answer": "a"}\n' % (b"p" * 330) for _ in range(400))  # ~145 kB

    def upload(rate: int) -> float:
        app = create_app(settings.model_copy(update={"upload_bytes_per_second": rate}))
        try:
            with app.state.db.session() as s:
                key = create_tenant_and_key(s, f"rate-{uuid.uuid4().hex[:6]}")[1]
            with TestClient(app) as client:
                t0 = time.monotonic()
                r = client.post(
                    "/v1/files", files={"file": ("d.jsonl", rows)}, headers={"Authorization": f"Bearer {key}"}
                )
                assert r.status_code == 201, r.text
                return time.monotonic() - t0
        finally:
            app.state.db.dispose()

    # A rate at which the upload takes at least 4x what it takes unlimited on this machine at this load (1 s
    # at least): a throttle that does nothing leaves it near the unlimited time, under the bound below.
    unlimited = upload(0)
    rate = int(len(rows) / max(1.0, 4 * unlimited))
    throttled = upload(rate)
    assert throttled >= len(rows) / rate * 0.9, (unlimited, rate, throttled)

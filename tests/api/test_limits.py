"""Limits and outages: streamed body caps, symlink escapes, broker down, database down and back."""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.errors import OPENAI_ROUTES
from store.models import File, Job, JobEvent
from store.settings import Settings
from store.tenants import create_tenant_and_key
from tests.api.conftest import job_body
from tests.api.test_files import count_files, stored_objects


def _chunks(total: int, size: int = 65536):
    sent = 0
    while sent < total:
        yield b"a" * min(size, total - sent)
        sent += size


def test_chunked_upload_over_the_cap_is_413_and_leaves_nothing(client, app, settings, auth):
    boundary = "gspoboundary"

    def body():  # no Content-Length: the size is only known by counting the stream
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            'Content-Type: application/octet-stream\r\n\r\n{"prompt": "'
        ).encode()
        yield from _chunks(settings.max_upload_bytes + 200_000)
        yield f'"}}\n\r\n--{boundary}--\r\n'.encode()

    r = client.post(
        "/v1/files", content=body(), headers={**auth, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    assert count_files(app) == 0 and stored_objects(settings) == []


def test_chunked_json_body_over_the_cap_is_413(client, settings, auth):
    r = client.post(
        "/v1/jobs",
        content=_chunks(settings.max_request_bytes + 1),
        headers={**auth, "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_symlinks_out_of_the_models_dir_are_refused(client, app, settings, auth, uploaded, tmp_path):
    outside = tmp_path / "outside" / "toy"  # a model directory in every way the API checks
    outside.mkdir(parents=True)
    (outside / "config.json").write_text("{}")
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    (settings.models_dir / "evil").symlink_to(outside, target_is_directory=True)
    (settings.models_dir / "org").mkdir()
    (settings.models_dir / "org" / "evil").symlink_to(outside, target_is_directory=True)
    # "org/evil" also looks like a hub id: the escaping local entry must win over that reading.
    for model in ("evil", "org/evil", "./evil", str(settings.models_dir / "evil")):
        r = client.post("/v1/jobs", json=job_body(uploaded["id"], model=model), headers=auth)
        assert r.status_code == 422 and r.json()["error"]["field"] == "model", (model, r.text)
    with app.state.db.session() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0


def _app_with_key(settings: Settings, tenant_prefix: str):
    """An app on ``settings`` and the auth header of a new tenant's key."""
    from api.app import create_app

    app = create_app(settings)
    with app.state.db.session() as s:
        _, key = create_tenant_and_key(s, f"{tenant_prefix}-{uuid.uuid4().hex[:6]}")
    return app, {"Authorization": f"Bearer {key}"}


def test_broker_down_is_503_and_creates_no_job(settings, toy_dataset):
    app, h = _app_with_key(settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"}), "nobroker")
    try:
        with TestClient(app) as c:
            fid = c.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=h).json()["id"]
            r = c.post("/v1/jobs", json=job_body(fid, model="org/model"), headers=h)
            assert r.status_code == 503 and r.json()["error"]["type"] == "broker_unavailable", r.text
            ready = c.get("/readyz")
            assert ready.status_code == 503 and ready.json()["broker"] == "unreachable"
        with app.state.db.session() as s:
            assert s.scalar(select(func.count()).select_from(Job)) == 0
            assert s.scalar(select(func.count()).select_from(JobEvent)) == 0
            assert s.scalar(select(func.count()).select_from(File)) == 1
    finally:
        app.state.db.dispose()


class TcpProxy:
    """A loopback TCP forwarder we can take down and bring back on the same port (a DB outage)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.conns, self.listener = target, [], None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    def start(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone would leave the port listening.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in self.conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.conns = []


def test_database_down_is_503_and_recovers_by_itself(pg_database, tmp_path):
    from sqlalchemy.engine import make_url

    url = make_url(pg_database)
    proxy = TcpProxy((url.host, url.port or 5432))
    proxy.start()
    app, h = _app_with_key(
        Settings(
            data_dir=tmp_path,
            database_url=url.set(port=proxy.port).render_as_string(False),
            models_dir=tmp_path / "models",
        ),
        "outage",
    )
    try:
        with TestClient(app) as c:
            assert c.get("/v1/jobs", headers=h).status_code == 200
            proxy.stop()
            r = c.get("/v1/jobs", headers=h)
            assert r.status_code == 503 and "database" in r.json()["error"]["message"], r.text
            assert r.headers["Retry-After"] and c.get("/readyz").json()["database"] == "unreachable"
            proxy.start()  # no restart of the API: the pool reconnects on its own
            assert c.get("/v1/jobs", headers=h).status_code == 200
            assert c.get("/readyz").json()["database"] == "ok"
    finally:
        app.state.db.dispose()
        proxy.stop()


@pytest.fixture()
def revoked_auth(app) -> dict:
    from store.tenants import revoke_key

    with app.state.db.session() as s:
        _, key = create_tenant_and_key(s, f"revoked-{uuid.uuid4().hex[:6]}")
        revoke_key(s, key)
    return {"Authorization": f"Bearer {key}"}


def test_every_v1_endpoint_needs_a_valid_key(client, app, revoked_auth):
    routes = [
        (m, r.path)
        for r in app.routes
        if getattr(r, "path", "").startswith("/v1")
        for m in sorted(getattr(r, "methods", ()) or ())
        if m != "HEAD"
    ]
    assert len(routes) >= 15
    for headers in ({}, {"Authorization": "Bearer gspo_wrong"}, {"Authorization": "Token x"}, revoked_auth):
        for method, path in routes:
            concrete = (
                path.replace("{job_id}", "job_x").replace("{file_id}", "file_x").replace("{checkpoint_id}", "ckpt_x")
            )
            r = client.request(method, concrete, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            # OpenAI's routes answer in OpenAI's shape, which the openai SDK maps to AuthenticationError.
            want = "authentication_error" if path.startswith(OPENAI_ROUTES) else "unauthorized"
            assert r.json()["error"]["type"] == want and r.headers["WWW-Authenticate"] == "Bearer"

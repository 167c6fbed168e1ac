"""Tenant isolation and authentication: another tenant's ids are 404, bad or revoked keys 401."""

from __future__ import annotations

import pytest

from store.tenants import revoke_key
from tests.api.conftest import job_body


def test_every_endpoint_hides_other_tenants_data(client, auth, other_auth, job_with_progress, uploaded):
    job = job_with_progress
    ckpt = client.get(f"/v1/jobs/{job}/checkpoints", headers=auth).json()["data"][0]["id"]
    fid = uploaded["id"]
    requests = [
        ("GET", f"/v1/files/{fid}"),
        ("GET", f"/v1/files/{fid}/content"),
        ("DELETE", f"/v1/files/{fid}"),
        ("GET", f"/v1/jobs/{job}"),
        ("POST", f"/v1/jobs/{job}/cancel"),
        ("GET", f"/v1/jobs/{job}/metrics"),
        ("GET", f"/v1/jobs/{job}/events"),
        ("GET", f"/v1/jobs/{job}/samples"),
        ("GET", f"/v1/jobs/{job}/checkpoints"),
        ("GET", f"/v1/checkpoints/{ckpt}"),
        ("GET", f"/v1/checkpoints/{ckpt}/download"),
    ]
    for method, path in requests:
        r = client.request(method, path, headers=other_auth)
        assert r.status_code == 404, (method, path, r.status_code)
        assert fid not in r.text or "not found" in r.text
    assert client.get("/v1/jobs", headers=other_auth).json()["data"] == []
    assert client.get("/v1/files", headers=other_auth).json()["data"] == []
    # Another tenant's file or checkpoint cannot be used in a job.
    r = client.post("/v1/jobs", json=job_body(fid), headers=other_auth)
    assert r.status_code == 404 and r.json()["error"]["field"] == "training_file"
    r = client.post("/v1/jobs", json=job_body(fid, model=f"ckpt:{ckpt}"), headers=auth)
    assert r.status_code == 201
    other_file = client.post(
        "/v1/files", files={"file": ("t.jsonl", b'{"prompt": "x", "target": "y"}\n')}, headers=other_auth
    ).json()["id"]
    r = client.post("/v1/jobs", json=job_body(other_file, model=f"ckpt:{ckpt}"), headers=other_auth)
    assert r.status_code == 404 and r.json()["error"]["field"] == "model"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}])
def test_missing_or_wrong_key_is_401(client, headers):
    for path in ("/v1/files", "/v1/jobs"):
        r = client.get(path, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"


def test_revoked_key_stops_at_once(client, app):
    from store.tenants import create_tenant_and_key

    with app.state.db.session() as s:
        _, key = create_tenant_and_key(s, "revokee")
    h = {"Authorization": f"Bearer {key}"}
    assert client.get("/v1/jobs", headers=h).status_code == 200
    with app.state.db.session() as s:
        assert revoke_key(s, key)
    assert client.get("/v1/jobs", headers=h).status_code == 401


def test_keys_are_stored_hashed(app):
    from sqlalchemy import select

    from store.models import ApiKey
    from store.tenants import create_tenant_and_key

    with app.state.db.session() as s:
        _, key = create_tenant_and_key(s, "hashcheck")
        hashes = list(s.scalars(select(ApiKey.key_hash)))
    assert key not in hashes and all(len(h) == 64 for h in hashes)


@pytest.mark.parametrize("key", ["../../etc/passwd", "/etc/passwd", "a/../../b", "", "a//b"])
def test_object_keys_cannot_escape_the_store(settings, key):
    from store.objects import BadKey, LocalObjectStore

    store = LocalObjectStore(settings.data_dir / "objects")
    with pytest.raises(BadKey):
        store.get_bytes(key)
    with pytest.raises(BadKey):
        store.put_bytes(key, b"x")


def test_path_traversal_in_urls_is_404(client, auth):
    for path in ("/v1/files/..%2F..%2Fetc%2Fpasswd/content", "/v1/checkpoints/..%2F..%2Fx/download"):
        assert client.get(path, headers=auth).status_code == 404


def test_stored_keys_that_escape_their_prefix_are_never_served(client, app, settings, auth):
    """Even a corrupted row (object key with ``..``) cannot make a download read outside the store."""
    from store.models import Checkpoint, File, Job
    from store.tenants import authenticate

    secret = settings.data_dir / "secret.txt"
    secret.write_text("top secret")
    with app.state.db.session() as s:
        tenant = authenticate(s, auth["Authorization"].split()[1])
        f = File(tenant_id=tenant.id, filename="x.jsonl", bytes=1, rows=1, object_key="../secret.txt", item_fields=[])
        gone = File(
            tenant_id=tenant.id,
            filename="y.jsonl",
            bytes=1,
            rows=1,
            object_key="tenants/x/files/gone.jsonl",
            item_fields=[],
        )
        s.add_all([f, gone])
        s.flush()
        job = Job(tenant_id=tenant.id, model="m", training_file_id=f.id, reward={}, hyperparameters={}, total_steps=1)
        s.add(job)
        s.flush()
        c = Checkpoint(job_id=job.id, tenant_id=tenant.id, step=1, object_prefix="..", size_bytes=1)
        s.add(c)
        s.flush()
        ids = f.id, gone.id, c.id
    for path in (f"/v1/files/{ids[0]}/content", f"/v1/files/{ids[1]}/content", f"/v1/checkpoints/{ids[2]}/download"):
        r = client.get(path, headers=auth)
        assert r.status_code == 404 and "top secret" not in r.text, (path, r.status_code, r.text)
        assert r.json()["error"]["type"] == "not_found"

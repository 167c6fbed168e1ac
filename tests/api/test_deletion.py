"""Tenants delete their data: finished jobs (with everything they produced), checkpoints, files that only
finished jobs used. Nothing of it stays readable and its storage is reclaimed (local and S3); what is
still in use is a 409 naming why."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from store import jobs, progress
from store.db import run_migrations
from store.models import Checkpoint, Job, JobEvent, PendingDeletion, Sample, StepMetric
from store.objects import S3ObjectStore, put_dir
from store.tenants import create_tenant_and_key
from tests.api.conftest import job_body
from tests.api.test_files import stored_objects


def _rows_of(app, job_id: str) -> dict:
    with app.state.db.session() as s:
        out = {
            t.__name__: s.scalar(select(func.count()).select_from(t).where(t.job_id == job_id))
            for t in (JobEvent, StepMetric, Sample, Checkpoint)
        }
        out["Job"] = s.scalar(select(func.count()).select_from(Job).where(Job.id == job_id))
        out["PendingDeletion"] = s.scalar(select(func.count()).select_from(PendingDeletion))
        return out


def _error(r, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == type_, err
    return err


def test_delete_a_finished_job_and_everything_it_made(
    client, app, settings, auth, other_auth, uploaded, job_with_progress
):
    job = job_with_progress
    ckpt = client.get(f"/v1/jobs/{job}/checkpoints", headers=auth).json()["data"][0]["id"]
    assert [p for p in stored_objects(settings) if f"jobs/{job}/" in str(p)]
    queued = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]
    err = _error(client.delete(f"/v1/jobs/{queued}", headers=auth), 409, "job_active")
    assert "queued" in err["message"] and err["field"] == "job_id"
    # Another job trains from this job's checkpoint: its base must stay while it is active.
    child = client.post("/v1/jobs", json=job_body(uploaded["id"], model=f"ckpt:{ckpt}"), headers=auth).json()["id"]
    assert child in _error(client.delete(f"/v1/jobs/{job}", headers=auth), 409, "checkpoint_in_use")["message"]
    assert client.delete(f"/v1/jobs/{job}", headers=other_auth).status_code == 404  # not another tenant's
    assert client.post(f"/v1/jobs/{child}/cancel", headers=auth).json()["status"] == "cancelled"

    assert client.delete(f"/v1/jobs/{job}", headers=auth).status_code == 204
    for path in (
        f"/v1/jobs/{job}",
        f"/v1/jobs/{job}/metrics",
        f"/v1/jobs/{job}/samples",
        f"/v1/jobs/{job}/events",
        f"/v1/jobs/{job}/checkpoints",
        f"/v1/checkpoints/{ckpt}",
        f"/v1/checkpoints/{ckpt}/download",
    ):
        assert client.get(path, headers=auth).status_code == 404, path
    assert _rows_of(app, job) == {
        "JobEvent": 0,
        "StepMetric": 0,
        "Sample": 0,
        "Checkpoint": 0,
        "Job": 0,
        "PendingDeletion": 0,
    }
    assert not [p for p in stored_objects(settings) if f"jobs/{job}/" in str(p)]
    assert queued in [j["id"] for j in client.get("/v1/jobs", headers=auth).json()["data"]]  # others untouched
    # A new job cannot name the deleted checkpoint; the finished one that did keeps its record.
    r = client.post("/v1/jobs", json=job_body(uploaded["id"], model=f"ckpt:{ckpt}"), headers=auth)
    assert r.status_code == 404 and r.json()["error"]["field"] == "model"
    assert client.get(f"/v1/jobs/{child}", headers=auth).json()["model"] == f"ckpt:{ckpt}"


def test_delete_a_checkpoint(client, app, settings, auth, uploaded, job_with_progress):
    job = job_with_progress
    ckpt = client.get(f"/v1/jobs/{job}/checkpoints", headers=auth).json()["data"][0]["id"]
    child = client.post("/v1/jobs", json=job_body(uploaded["id"], model=f"ckpt:{ckpt}"), headers=auth).json()["id"]
    assert child in _error(client.delete(f"/v1/checkpoints/{ckpt}", headers=auth), 409, "checkpoint_in_use")["message"]
    with app.state.db.session() as s:  # a worker takes the child: the checkpoint is still its base
        jobs.claim(s, child, "w", 30)
    _error(client.delete(f"/v1/checkpoints/{ckpt}", headers=auth), 409, "checkpoint_in_use")
    with app.state.db.session() as s:
        jobs.transition(s, s.get(Job, child), "failed", error="x")
    assert client.delete(f"/v1/checkpoints/{ckpt}", headers=auth).status_code == 204
    assert client.get(f"/v1/checkpoints/{ckpt}", headers=auth).status_code == 404
    assert client.get(f"/v1/jobs/{job}/checkpoints", headers=auth).json()["data"] == []
    assert not [p for p in stored_objects(settings) if "/checkpoints/" in str(p)]
    assert client.get(f"/v1/jobs/{job}/metrics", headers=auth).json()["data"]  # the job keeps the rest


def test_checkpoints_of_a_running_job_stay(client, app, auth, uploaded, model_name, tmp_path):
    job = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]
    (tmp_path / "c" / "model").mkdir(parents=True)
    (tmp_path / "c" / "model" / "config.json").write_text("{}")
    with app.state.db.session() as s:
        row = jobs.claim(s, job, "w", 30)
        put_dir(app.state.objects, f"jobs/{job}/checkpoints/step-000001", tmp_path / "c")
        ckpt = progress.record_checkpoint(s, row, 1, f"jobs/{job}/checkpoints/step-000001", 2, False).id
    err = _error(client.delete(f"/v1/checkpoints/{ckpt}", headers=auth), 409, "checkpoint_in_use")
    assert "running" in err["message"]
    assert "running" in _error(client.delete(f"/v1/jobs/{job}", headers=auth), 409, "job_active")["message"]


def test_a_file_only_finished_jobs_used_can_be_deleted(client, app, settings, auth, uploaded, model_name):
    job = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]
    assert "queued" in _error(client.delete(f"/v1/files/{uploaded['id']}", headers=auth), 409, "file_in_use")["message"]
    client.post(f"/v1/jobs/{job}/cancel", headers=auth)
    assert client.delete(f"/v1/files/{uploaded['id']}", headers=auth).status_code == 204
    assert client.get(f"/v1/files/{uploaded['id']}", headers=auth).status_code == 404
    assert client.get(f"/v1/files/{uploaded['id']}/content", headers=auth).status_code == 404
    assert [p.name for p in stored_objects(settings)] == [f"results-{job}.csv"]  # the job's results file stays
    finished = client.get(f"/v1/jobs/{job}", headers=auth).json()
    assert finished["training_file"] is None and finished["status"] == "cancelled"
    assert client.delete(f"/v1/jobs/{job}", headers=auth).status_code == 204


def test_deletion_reclaims_s3_objects(s3_settings, tmp_path, toy_dataset):
    from api.app import create_app

    settings = s3_settings.model_copy(
        update={"data_dir": tmp_path, "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}"}
    )
    run_migrations(settings.resolved_database_url())
    S3ObjectStore(settings).ensure_bucket()
    app = create_app(settings)
    with app.state.db.session() as s:
        tenant, key = create_tenant_and_key(s, "s3-deleter")
    h = {"Authorization": f"Bearer {key}"}
    (tmp_path / "c" / "model").mkdir(parents=True)
    (tmp_path / "c" / "model" / "config.json").write_text("{}")
    objects = app.state.objects
    with TestClient(app) as c:
        fid = c.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=h).json()["id"]
        job = c.post("/v1/jobs", json=job_body(fid, model="org/model"), headers=h).json()["id"]
        with app.state.db.session() as s:
            row = jobs.claim(s, job, "w", 30)
            for step in (1, 2):
                put_dir(objects, f"jobs/{job}/checkpoints/step-00000{step}", tmp_path / "c")
                progress.record_checkpoint(s, row, step, f"jobs/{job}/checkpoints/step-00000{step}", 2, step == 2)
            jobs.transition(s, row, "succeeded")
        first = c.get(f"/v1/jobs/{job}/checkpoints", headers=h).json()["data"][0]["id"]
        assert len(objects.list(f"jobs/{job}")) == 2 and len(objects.list(f"tenants/{tenant.id}")) == 1
        assert c.delete(f"/v1/checkpoints/{first}", headers=h).status_code == 204
        assert len(objects.list(f"jobs/{job}")) == 1
        assert c.delete(f"/v1/jobs/{job}", headers=h).status_code == 204
        assert c.delete(f"/v1/files/{fid}", headers=h).status_code == 204
        assert objects.list(f"jobs/{job}") == [] and objects.list(f"tenants/{tenant.id}") == []
    app.state.db.dispose()


def test_objects_left_by_an_interrupted_deletion_are_purged_at_start(app, settings):
    """Rows deleted, then the process died before the objects went: the next start removes them."""
    app.state.objects.put_bytes("jobs/job_gone/checkpoints/step-000001/model/config.json", b"{}")
    with app.state.db.session() as s:
        s.add(PendingDeletion(prefix="jobs/job_gone"))
    with TestClient(app):
        deadline = time.monotonic() + 20
        while _rows_of(app, "job_gone")["PendingDeletion"]:  # the record goes once the objects have
            assert time.monotonic() < deadline, "leftovers were not purged"
            time.sleep(0.05)
    assert stored_objects(settings) == []


def test_a_job_created_while_its_file_is_deleted_is_a_404(client, app, settings, auth, uploaded, model_name):
    """The deletion holds the file's row until it commits; a job being created from the file meanwhile
    fails on the foreign key: a 404 naming the file, never a 500 or a job without its file."""
    import threading

    from sqlalchemy import delete as sql_delete

    from store.models import File

    s = app.state.db.new_session()
    s.execute(select(File).where(File.id == uploaded["id"]).with_for_update())
    s.execute(sql_delete(File).where(File.id == uploaded["id"]))
    answer: list = []
    t = threading.Thread(
        target=lambda: answer.append(client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth))
    )
    t.start()
    time.sleep(1.5)  # the job's insert now waits for the file's row
    s.commit()
    s.close()
    t.join(60)
    r = answer[0]
    sqlite_busy = settings.resolved_database_url().startswith("sqlite") and r.status_code == 503
    assert sqlite_busy or (r.status_code == 404 and r.json()["error"]["field"] == "training_file"), r.text
    with app.state.db.session() as s2:
        assert s2.scalar(select(func.count()).select_from(Job)) == 0


@pytest.mark.parametrize("settings", ["sqlite"], indirect=True)
def test_deleted_rows_do_not_stay_in_sqlites_wal(client, settings, auth, uploaded, model_name):
    """A deleted job's credentials and a deleted webhook's signing secret leave the disk at once: the WAL is
    checkpointed and truncated after a deletion, and the freed space is zeroed (``secure_delete``)."""
    token = f"wal-secret-{uuid.uuid4().hex}"
    hook = {"type": "http", "url": "http://rm.invalid/score", "headers": {"Authorization": f"Bearer {token}"}}
    job = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "reward": hook}, headers=auth).json()["id"]
    assert client.post(f"/v1/jobs/{job}/cancel", headers=auth).json()["status"] == "cancelled"
    ep = client.post("/v1/webhooks", json={"url": "https://example.com/h"}, headers=auth).json()
    db = Path(settings.database_url.split("///", 1)[1])
    wal = db.with_name(db.name + "-wal")

    def on_disk(secret: str) -> list[str]:
        return [p.name for p in (db, wal) if p.exists() and secret.encode() in p.read_bytes()]

    assert on_disk(token) and on_disk(ep["secret"])  # written, so the check below can fail
    assert client.delete(f"/v1/jobs/{job}", headers=auth).status_code == 204
    assert client.delete(f"/v1/webhooks/{ep['id']}", headers=auth).status_code == 204
    assert on_disk(token) == [] and on_disk(ep["secret"]) == []
    assert not wal.exists() or wal.stat().st_size == 0

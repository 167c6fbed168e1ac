"""With S3 configured, a checkpoint download redirects to a presigned URL of the worker's archive."""

from __future__ import annotations

import io
import tarfile

import httpx
from fastapi.testclient import TestClient

from store import jobs, progress
from store.db import run_migrations
from store.objects import S3ObjectStore, put_dir
from store.tenants import create_tenant_and_key
from worker.persist import build_archive


def test_presigned_redirect(s3_settings, tmp_path, toy_dataset):
    from api.app import create_app
    from tests.api.conftest import job_body

    settings = s3_settings.model_copy(
        update={"data_dir": tmp_path, "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}", "allow_hub_models": True}
    )
    run_migrations(settings.resolved_database_url())
    S3ObjectStore(settings).ensure_bucket()
    app = create_app(settings)
    with app.state.db.session() as s:
        _, key = create_tenant_and_key(s, "s3-tenant")
    h = {"Authorization": f"Bearer {key}"}
    with TestClient(app) as c:
        fid = c.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=h).json()["id"]
        job_id = c.post("/v1/jobs", json=job_body(fid, model="org/model"), headers=h).json()["id"]
        ckpt = tmp_path / "step-000001"
        (ckpt / "model").mkdir(parents=True)
        (ckpt / "model" / "config.json").write_text("{}")
        prefix = f"jobs/{job_id}/checkpoints/step-000001"
        put_dir(app.state.objects, prefix, ckpt)
        app.state.objects.put_file(f"{prefix}/archive.tar.gz", build_archive(ckpt, "root"))
        with app.state.db.session() as s:
            job = jobs.claim(s, job_id, "w", 30)
            ckpt_id = progress.record_checkpoint(s, job, 1, prefix, 2, True).id
        r = c.get(f"/v1/checkpoints/{ckpt_id}/download", headers=h, follow_redirects=False)
        assert r.status_code == 307 and "Signature=" in r.headers["location"]
        body = httpx.get(r.headers["location"]).content
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert tar.getnames() == ["root/model", "root/model/config.json"]

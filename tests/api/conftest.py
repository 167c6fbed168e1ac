"""API test fixtures: the real app on SQLite and on a fresh PostgreSQL database, two tenants."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from gspo_core.toy import build_tiny_model, write_toy_dataset
from store.settings import Settings
from store.tenants import create_tenant_and_key
from tests.conftest import empty_database_url


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path):
    return Settings(
        data_dir=tmp_path,
        database_url=empty_database_url(request, tmp_path),
        models_dir=tmp_path / "models",
        max_upload_bytes=200_000,
        max_file_rows=500,
        max_active_jobs_per_tenant=3,
    )


@pytest.fixture()
def app(settings):
    from api.app import create_app

    app = create_app(settings)
    yield app
    app.state.db.dispose()


@pytest.fixture()
def client(app):
    with TestClient(app) as c:
        yield c


def _key(app, name: str) -> str:
    with app.state.db.session() as s:
        _, key = create_tenant_and_key(s, f"{name}-{uuid.uuid4().hex[:6]}")
    return key


@pytest.fixture()
def auth(app) -> dict:
    return {"Authorization": f"Bearer {_key(app, 'acme')}"}


@pytest.fixture()
def other_auth(app) -> dict:
    return {"Authorization": f"Bearer {_key(app, 'globex')}"}


@pytest.fixture(scope="session")
def toy_dataset(tmp_path_factory):
    return write_toy_dataset(tmp_path_factory.mktemp("data") / "toy.jsonl", n=16).read_bytes()


@pytest.fixture()
def model_name(settings) -> str:
    build_tiny_model(settings.models_dir / "toy", shape="toy")
    return "toy"


@pytest.fixture()
def uploaded(client, auth, toy_dataset) -> dict:
    r = client.post("/v1/files", files={"file": ("toy.jsonl", toy_dataset)}, headers=auth)
    assert r.status_code == 201, r.text
    return r.json()


def job_body(file_id: str, model: str = "toy", **hp) -> dict:
    from gspo_core.toy import TOY_REWARD

    return {
        "model": model,
        "training_file": file_id,
        "reward": TOY_REWARD,
        "hyperparameters": {"steps": 2, "group_size": 4, "prompts_per_step": 2, **hp},
    }

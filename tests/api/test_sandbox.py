"""Python graders through the API, as a tenant would send them: the attack suite against a real app on
SQLite (database, other tenants' files and checkpoints in its data directory), refusal where the host
cannot isolate them, and what /readyz reports."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gspo_core.rewards.isolation import isolation_for
from gspo_core.toy import build_tiny_model, write_toy_dataset
from store.db import run_migrations
from store.settings import Settings
from store.tenants import create_tenant_and_key
from tests.api.conftest import job_body
from tests.conftest import grader_policy
from tests.sandbox_attacks import (
    assert_expected_errors,
    attack_item,
    attack_spec,
    check_attack_results,
    find_spec,
    listening_port,
    new_secret,
    planted_markers,
)

REPO = Path(__file__).resolve().parents[2]
OK = {"type": "python", "source": "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])"}


def make_app(data_dir: Path, **settings):
    from api.app import create_app

    s = Settings(data_dir=data_dir, **settings)
    run_migrations(s.resolved_database_url())
    app = create_app(s)
    client = TestClient(app)
    keys = []
    for name in ("attacker", "victim"):
        with app.state.db.session() as db:
            keys.append({"Authorization": f"Bearer {create_tenant_and_key(db, f'{name}-{uuid.uuid4().hex[:6]}')[1]}"})
    return app, client, keys


def test_attacks_through_rewards_run_score_zero_and_leak_nothing(tmp_path, monkeypatch):
    secret = new_secret()
    monkeypatch.setenv("GSPO_TEST_SECRET", secret)  # in the API process's environment
    data_dir = tmp_path / "data"
    app, client, (attacker, victim) = make_app(data_dir)
    srv, port = listening_port()
    try:
        up = client.post(
            "/v1/files", files={"file": ("v.jsonl", f'{{"prompt": "{secret}", "answer": "a"}}\n')}, headers=victim
        )
        assert up.status_code == 201, up.text
        app.state.objects.put_bytes(
            "jobs/job-victim/checkpoints/step-000001-a1/model/model.safetensors", secret.encode()
        )
        assert (data_dir / "gspo.db").exists()
        item = attack_item(data_dir, [os.getpid()], port, str(Path(isolation_for(grader_policy()).python).parents[1]))
        r = client.post(
            "/v1/rewards/run", json={"reward": attack_spec(), "item": item, "samples": ["a", "b"]}, headers=attacker
        )
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        check_attack_results(results, [secret])
        assert_expected_errors(results[0]["errors"])
        found = client.post(
            "/v1/rewards/run", json={"reward": find_spec(), "item": item, "samples": ["a"]}, headers=attacker
        ).json()["results"][0]
        assert found["reward"] == 0.0 and "no marker" in found["errors"]["find"], found
        assert planted_markers(data_dir, REPO) == []
        # The API carries on, for this tenant and the others.
        assert client.get("/healthz").json() == {"status": "ok"}
        ok = client.post(
            "/v1/rewards/run", json={"reward": OK, "item": {"answer": "a"}, "samples": ["a", "b"]}, headers=victim
        ).json()["results"]
        assert [x["reward"] for x in ok] == [1.0, 0.0]
    finally:
        srv.close()
        client.close()
        app.state.db.dispose()


def test_no_isolation_is_a_422_naming_the_field_and_readyz_says_so(tmp_path):
    build_tiny_model(tmp_path / "data" / "models" / "toy", shape="toy")
    app, client, (tenant, _) = make_app(tmp_path / "data", sandbox_bwrap=str(tmp_path / "no-bwrap"))
    try:
        run = client.post(
            "/v1/rewards/run", json={"reward": OK, "item": {"answer": "a"}, "samples": ["a"]}, headers=tenant
        )
        assert run.status_code == 422 and run.json()["error"]["field"] == "reward.type", run.text
        assert "cannot isolate" in run.json()["error"]["message"] and str(tmp_path) not in run.text
        file_id = client.post(
            "/v1/files",
            files={"file": ("t.jsonl", write_toy_dataset(tmp_path / "t.jsonl", n=8).read_bytes())},
            headers=tenant,
        ).json()["id"]
        body = job_body(file_id)
        body["reward"] = {"type": "multi", "graders": {"ok": OK}, "calculate_output": "ok"}
        job = client.post("/v1/jobs", json=body, headers=tenant)
        assert job.status_code == 422 and job.json()["error"]["field"] == "reward.graders.ok.type", job.text
        assert client.get("/v1/jobs", headers=tenant).json()["data"] == []
        ready = client.get("/readyz").json()
        assert ready["sandbox"] == "refused" and ready["sandbox_reason"] == "bubblewrap is not installed", ready
    finally:
        client.close()
        app.state.db.dispose()


def test_weak_isolation_when_the_operator_allows_it(tmp_path):
    app, client, (tenant, _) = make_app(
        tmp_path / "data", sandbox_bwrap=str(tmp_path / "no-bwrap"), allow_weak_sandbox=True
    )
    try:
        r = client.post(
            "/v1/rewards/run", json={"reward": OK, "item": {"answer": "a"}, "samples": ["a", "b"]}, headers=tenant
        )
        assert r.status_code == 200 and [x["reward"] for x in r.json()["results"]] == [1.0, 0.0], r.text
        assert client.get("/readyz").json()["sandbox"] == "weak"
    finally:
        client.close()
        app.state.db.dispose()


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"timeout_s": 61}, "reward.timeout_s"),
        ({"memory_mb": 2048}, "reward.memory_mb"),
        ({"max_concurrency": 9}, "reward.max_concurrency"),
    ],
)
def test_over_the_operator_maxima_is_a_422(tmp_path, spec, field):
    app, client, (tenant, _) = make_app(tmp_path / "data")
    try:
        r = client.post("/v1/rewards/run", json={"reward": {**OK, **spec}, "samples": ["a"]}, headers=tenant)
        assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
        assert client.get("/readyz").json()["sandbox"] == "bubblewrap"
    finally:
        client.close()
        app.state.db.dispose()

"""Tinker sessions as tenants' resources in the app itself (no worker): the device-hour budget (402), the fair
order of the session queue across tenants, listing, describing and finishing sessions, weights info, the
dashboard's session list, and the SDK routes this service refuses (400 naming what)."""

from __future__ import annotations

import pytest

from store import tinker
from store.models import TinkerModel, TinkerRequest, TinkerSession, UsageRecord, utcnow
from store.settings import Settings
from store.usage import QueuePolicy
from tests.api.tinker_support import open_session as _session
from tests.api.tinker_support import tml as _tml
from tests.conftest import empty_database_url

BUDGET_H = 1.0


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path):
    (tmp_path / "models" / "toy").mkdir(parents=True)
    (tmp_path / "models" / "toy" / "config.json").write_text("{}")
    return Settings(
        data_dir=tmp_path,
        database_url=empty_database_url(request, tmp_path),
        models_dir=tmp_path / "models",
        max_active_sessions_per_tenant=5,
        tenant_device_hours_per_period=BUDGET_H,
        tinker_long_poll_seconds=0.2,
    )


def _model(client, headers, session_id: str) -> str:
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": "toy", "lora_config": {"rank": 2}}
    r = client.post("/api/v1/create_model", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["model_id"]


def _use(app, settings: Settings, tenant_id: str, seconds: float) -> None:
    """Device time the tenant spent this period (as a job's or a session's usage row)."""
    period = QueuePolicy.of(settings).period_start(utcnow())
    with app.state.db.session() as s:
        row = UsageRecord(tenant_id=tenant_id, job_id=f"job-{seconds}", run_id="w", attempt=1, period_start=period)
        row.device_seconds, row.tokens_sampled, row.tokens_trained = seconds, 0, 0
        s.add(row)
        s.commit()


def test_a_spent_budget_refuses_new_sessions_and_work_with_a_402(client, app, settings, auth, other_auth):
    headers = _tml(auth)
    session_id = _session(client, headers)
    model_id = _model(client, headers, session_id)
    with app.state.db.session() as s:
        tenant_id = s.get(TinkerSession, session_id).tenant_id
    _use(app, settings, tenant_id, BUDGET_H * 3600)

    r = client.post("/api/v1/create_session", json={"tags": []}, headers=headers)
    assert r.status_code == 402, r.text
    error = r.json()["error"]
    assert error["type"] == "budget_exhausted" and "device-hour budget used (1 of 1 h" in error["message"]
    assert int(r.headers["Retry-After"]) > 0
    step = client.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {}}, headers=headers)
    assert step.status_code == 402 and step.json()["error"]["type"] == "budget_exhausted"
    r = client.post("/api/v1/session_heartbeat", json={"session_id": session_id}, headers=headers)
    assert r.status_code == 200  # a session stays open; only new work waits for the budget
    assert client.get("/api/v1/sessions", headers=headers).status_code == 200
    _session(client, _tml(other_auth))  # another tenant's budget is its own


def test_the_session_queue_serves_the_tenant_that_used_least_first(client, app, settings, auth, other_auth):
    heavy, light = _tml(auth), _tml(other_auth)
    heavy_models = [_model(client, heavy, _session(client, heavy)) for _ in range(3)]
    light_model = _model(client, light, _session(client, light))  # queued after all of heavy's
    with app.state.db.session() as s:
        heavy_id = s.get(TinkerModel, heavy_models[0]).tenant_id
        light_id = s.get(TinkerModel, light_model).tenant_id
    policy = QueuePolicy.of(settings)
    with app.state.db.session() as s:  # no usage yet: arrival order
        first = tinker.claim_next(s, "w1", 30, policy)
        assert first is not None and first.model_id == heavy_models[0]
        tinker.finish(s, first.id, {})
    _use(app, settings, heavy_id, 60)
    with app.state.db.session() as s:  # heavy used device time: light's request goes ahead of heavy's older ones
        nxt = tinker.claim_next(s, "w1", 30, policy)
        assert nxt is not None and nxt.model_id == light_model and nxt.tenant_id == light_id
        tinker.finish(s, nxt.id, {})
    _use(app, settings, light_id, 120)
    with app.state.db.session() as s:  # now light used more: heavy's next
        nxt = tinker.claim_next(s, "w1", 30, policy)
        assert nxt is not None and nxt.tenant_id == heavy_id


def test_sessions_are_listed_described_and_finished_per_tenant(client, app, auth, other_auth):
    headers, other = _tml(auth), _tml(other_auth)
    session_id = _session(client, headers)
    model_id = _model(client, headers, session_id)
    _session(client, other)
    assert client.get("/api/v1/sessions", headers=headers).json() == {"sessions": [session_id]}
    r = client.get(f"/api/v1/sessions/{session_id}", headers=headers)
    assert r.json()["training_run_ids"] == [model_id] and r.json()["status"] == "active"
    assert client.get(f"/api/v1/sessions/{session_id}", headers=other).status_code == 404

    rows = client.get("/v1/sessions", headers=auth).json()["data"]  # the dashboard's list
    assert [(x["id"], x["base_models"], x["pending"], x["steps"]) for x in rows] == [(session_id, ["toy"], 1, 0)]

    finish = {"reason": {"type": "success"}, "detail": "done"}
    assert client.post(f"/api/v1/sessions/{session_id}/finish", json=finish, headers=other).status_code == 404
    assert client.post(f"/api/v1/sessions/{session_id}/finish", json=finish, headers=headers).status_code == 200
    again = {"reason": {"type": "errored"}}
    assert client.post(f"/api/v1/sessions/{session_id}/finish", json=again, headers=headers).status_code == 200
    described = client.get(f"/api/v1/sessions/{session_id}", headers=headers).json()
    assert described["status"] == "closed" and described["closed_reason"] == "finished by the client (success): done"
    step = client.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {}}, headers=headers)
    assert step.status_code == 409  # its models are unloaded
    with app.state.db.session() as s:
        assert {r.status for r in s.query(TinkerRequest).filter_by(session_id=session_id)} == {"failed"}
    r = client.post(f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "nope"}}, headers=headers)
    assert r.status_code == 422 and r.json()["error"]["field"] == "reason.type"


def test_weights_info_names_the_checkpoints_model(client, app, auth, other_auth):
    headers = _tml(auth)
    model_id = _model(client, headers, _session(client, headers))
    with app.state.db.session() as s:
        tinker.record_checkpoint(s, s.get(TinkerModel, model_id), "training", "step-1", "/nowhere", "p", 1)
    path = f"tinker://{model_id}/weights/step-1"
    r = client.post("/api/v1/weights_info", json={"tinker_path": path}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["base_model"] == "toy" and r.json()["is_lora"] and r.json()["lora_rank"] == 2
    assert client.post("/api/v1/weights_info", json={"tinker_path": path}, headers=_tml(other_auth)).status_code == 404
    r = client.post("/api/v1/weights_info", json={"tinker_path": "s3://x"}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["field"] == "tinker_path"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/api/v1/training_runs/r/checkpoints/sampler_weights/s/publish"),
        ("DELETE", "/api/v1/training_runs/r/checkpoints/sampler_weights/s/publish"),
        ("PUT", "/api/v1/training_runs/r/checkpoints/weights/s/ttl"),
        ("POST", "/api/v1/retrieve_futures"),
        ("POST", "/api/v1/cancel_future"),
    ],
)
def test_routes_not_offered_are_a_400_saying_so(client, auth, method, path):
    r = client.request(method, path, headers=_tml(auth))
    assert r.status_code == 400 and r.json()["error"]["type"] == "unsupported", r.text
    assert "not offered by this service" in r.json()["error"]["message"]
    assert client.request(method, path).status_code == 401


def test_work_queued_before_the_budget_ran_out_fails_on_the_worker_saying_why(client, app, settings, auth):
    from worker.sessions import _over_budget

    headers = _tml(auth)
    model_id = _model(client, headers, _session(client, headers))
    policy = QueuePolicy.of(settings)
    with app.state.db.session() as s:
        request = tinker.claim_next(s, "w1", 30, policy)
        assert request is not None and request.model_id == model_id
        s.expunge(request)
    assert not _over_budget(app.state.db, policy, request)
    _use(app, settings, request.tenant_id, BUDGET_H * 3600)
    assert _over_budget(app.state.db, policy, request)
    r = client.post("/api/v1/retrieve_future", json={"request_id": request.id}, headers=headers)
    assert r.status_code == 200 and r.json()["category"] == "user"
    assert r.json()["error"].startswith("tenant device-hour budget used (1 of 1 h this period) until ")

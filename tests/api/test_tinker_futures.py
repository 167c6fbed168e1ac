"""Tinker API sessions and futures in the app itself (no worker): the session cap and idle close, queue order,
try_again (408) with the queue state, a dead worker's session (its requests fail, it is freed), a model's resume
point, results, another tenant's 404s."""

from __future__ import annotations

import time

import pytest

from store import tinker, tinker_resume
from store.models import TinkerRequest, TinkerSession, utcnow
from store.settings import Settings
from tests.api.tinker_support import open_session as _session
from tests.api.tinker_support import tml as _tml
from tests.conftest import empty_database_url


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path):
    (tmp_path / "models" / "toy").mkdir(parents=True)
    (tmp_path / "models" / "toy" / "config.json").write_text("{}")
    return Settings(
        data_dir=tmp_path,
        database_url=empty_database_url(request, tmp_path),
        models_dir=tmp_path / "models",
        max_active_sessions_per_tenant=2,
        session_idle_seconds=2,
        tinker_long_poll_seconds=0.2,
    )


def _model(client, headers, session_id: str) -> tuple[str, str]:
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": "toy", "lora_config": {"rank": 2}}
    r = client.post("/api/v1/create_model", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["model_id"], r.json()["request_id"]


def _retrieve(client, headers, request_id: str):
    return client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)


def test_session_cap_is_a_429_and_idle_sessions_free_their_place(client, auth):
    headers = _tml(auth)
    _session(client, headers)
    _session(client, headers)
    r = client.post("/api/v1/create_session", json={"tags": []}, headers=headers)
    assert r.status_code == 429 and "sessions" in r.json()["error"]["message"]
    time.sleep(2.5)  # both idle past session_idle_seconds: closed on the next create_session
    _session(client, headers)


def test_futures_wait_in_order_then_answer_the_result(client, app, auth, other_auth):
    headers = _tml(auth)
    session_id = _session(client, headers)
    model_id, create_id = _model(client, headers, session_id)
    assert model_id == f"{session_id}:train:0"  # the id the SDK derives itself
    step = client.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {}}, headers=headers)
    step_id = step.json()["request_id"]

    r = _retrieve(client, headers, step_id)
    assert r.status_code == 408
    assert r.json() == {
        "type": "try_again",
        "request_id": step_id,
        "queue_state": "active",
        "queue_state_reason": "1 requests ahead",
    }
    assert _retrieve(client, headers, create_id).json()["queue_state"] == "paused_capacity"  # no worker took it
    assert _retrieve(client, _tml(other_auth), create_id).status_code == 404
    assert _retrieve(client, headers, "tr_missing").status_code == 404

    with app.state.db.session() as s:  # a worker takes the first request, in arrival order
        claimed = tinker.claim_next(s, "w1", 30)
        assert claimed is not None and claimed.id == create_id
        assert tinker.claim_next(s, "w2", 30) is None  # the session is w1's, and busy
        tinker.finish(s, create_id, {"type": "create_model", "model_id": model_id})
        assert tinker.claim_next(s, "w2", 30) is None  # still w1's lease
        claimed = tinker.claim_next(s, "w1", 30)
        assert claimed is not None and claimed.id == step_id
        tinker.finish(s, step_id, None, "ValueError: bad", "user")
    assert _retrieve(client, headers, create_id).json() == {"type": "create_model", "model_id": model_id}
    assert _retrieve(client, headers, step_id).json() == {"error": "ValueError: bad", "category": "user"}


def test_finish_closes_the_session_and_frees_its_place(client, app, auth, other_auth):
    """`ServiceClient.close` (the cookbook's loops leave its `with` block): POST /sessions/{id}/finish."""
    headers = _tml(auth)
    session_id = _session(client, headers)
    _session(client, headers)  # the tenant's cap (2) reached
    model_id, create_id = _model(client, headers, session_id)
    finish = f"/api/v1/sessions/{session_id}/finish"
    assert client.post(finish, json={"reason": {"type": "success"}}, headers=_tml(other_auth)).status_code == 404
    r = client.post(finish, json={"reason": {"type": "finished"}}, headers=headers)
    assert r.status_code == 422 and r.json()["error"]["field"] == "reason.type"

    r = client.post(finish, json={"reason": {"type": "errored"}, "detail": "boom"}, headers=headers)
    assert r.status_code == 200, r.text
    assert _retrieve(client, headers, create_id).json()["error"] == (
        "session closed: finished by the client (errored): boom"
    )  # its pending request failed, which the SDK raises
    r = client.post("/api/v1/session_heartbeat", json={"session_id": session_id}, headers=headers)
    assert r.status_code == 409 and "errored" in r.json()["error"]["message"]
    assert client.post("/api/v1/get_info", json={"model_id": model_id}, headers=headers).status_code == 409
    # the SDK retries its finish: a no-op that keeps the first reason
    r = client.post(finish, json={"reason": {"type": "success"}, "detail": None}, headers=headers)
    assert r.status_code == 200
    r = client.post("/api/v1/session_heartbeat", json={"session_id": session_id}, headers=headers)
    assert "(errored): boom" in r.json()["error"]["message"]
    _session(client, headers)  # its place under the cap is free again


def test_a_dead_workers_session_fails_its_unfinished_requests_and_is_freed(client, app, auth):
    """Its lease ran out: the running and the queued requests fail saying so (the SDK raises them), the session
    goes to the next worker, which drops what it kept of it; a stopping worker hands its sessions back alike."""
    headers = _tml(auth)
    session_id = _session(client, headers)
    model_id, create_id = _model(client, headers, session_id)
    steps = [
        client.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {}}, headers=headers).json()
        for _ in range(2)
    ]
    taken: list[str] = []
    with app.state.db.session() as s:
        assert tinker.claim_next(s, "w1", 0.01).id == create_id
        tinker.finish(s, create_id, {"type": "create_model", "model_id": model_id})
        time.sleep(0.05)
        assert tinker.claim_next(s, "w2", 30, taken=taken.append) is None  # not before the reaper freed it
        assert tinker.claim_next(s, "w1", 0.01).id == steps[0]["request_id"]  # w1 had not lost it yet
        time.sleep(0.05)
        assert tinker_resume.not_held(s, "w1", [session_id]) == []
        assert tinker_resume.reap_lost(s) == [session_id]
        assert tinker_resume.reap_lost(s) == []
        assert tinker_resume.not_held(s, "w1", [session_id]) == [session_id]  # w1 drops its models if it wakes
        tinker.finish(s, steps[0]["request_id"], {"type": "optim_step"})  # a late result keeps the failure
    assert _retrieve(client, headers, create_id).json() == {"type": "create_model", "model_id": model_id}
    for step in steps:  # the running one and the queued one
        r = _retrieve(client, headers, step["request_id"])
        assert r.status_code == 200 and r.json()["category"] == "server"
        assert r.json()["error"].startswith("the worker holding this session died before this request finished")
    unload = client.post("/api/v1/unload_model", json={"model_id": model_id}, headers=headers).json()
    with app.state.db.session() as s:
        claimed = tinker.claim_next(s, "w2", 30, taken=taken.append)
        assert claimed is not None and claimed.id == unload["request_id"] and taken == [session_id]
        tinker.finish(s, claimed.id, {})
        assert tinker_resume.hand_back(s, "w2") == [session_id]
        assert s.get(TinkerSession, session_id).lease_owner is None


def _done(s, session_id: str, model_id: str, kind: str, payload: dict | None = None) -> None:
    """A request the worker ran on the model, finished now."""
    row = TinkerRequest(
        tenant_id=s.get(TinkerSession, session_id).tenant_id,
        session_id=session_id,
        model_id=model_id,
        kind=kind,
        payload=payload or {},
        status="done",
        finished_at=utcnow(),
    )
    s.add(row)
    s.commit()
    time.sleep(0.002)  # finished_at orders the log


def test_a_models_resume_point_is_its_last_saved_state_and_what_it_lacks(client, app, auth):
    headers = _tml(auth)
    session_id = _session(client, headers)
    model_id, _ = _model(client, headers, session_id)
    saved = {"kind": "training", "name": "a", "path": "tinker://m/weights/a"}
    with app.state.db.session() as s:
        point = lambda: tinker_resume.resume_point(s, model_id)  # noqa: E731
        assert point() == tinker_resume.ResumePoint(None, False, 0)  # as made: rebuilt exactly
        _done(s, session_id, model_id, "forward_backward")
        _done(s, session_id, model_id, "forward")  # changes nothing
        assert point().behind == 1 and point().path is None  # trained, nothing saved: lost
        _done(s, session_id, model_id, "optim_step")
        _done(s, session_id, model_id, "save_weights", saved)
        assert point() == tinker_resume.ResumePoint("tinker://m/weights/a", True, 0)
        _done(s, session_id, model_id, "save_weights", {**saved, "kind": "sampler", "path": "tinker://m/s/b"})
        _done(s, session_id, model_id, "forward_backward")
        _done(s, session_id, model_id, "optim_step")
        assert point().path == "tinker://m/weights/a" and point().behind == 2
        _done(s, session_id, model_id, "forward_backward")  # a gradient the next save does not hold
        _done(s, session_id, model_id, "save_weights", {**saved, "name": "c", "path": "tinker://m/weights/c"})
        assert (point().path, point().behind) == ("tinker://m/weights/c", 1)
        loaded = {"path": "tinker://x/weights/d", "optimizer": False}
        _done(s, session_id, model_id, "load_weights", loaded)
        assert point() == tinker_resume.ResumePoint("tinker://x/weights/d", False, 1)
        _done(s, session_id, model_id, "optim_step")
        assert point().behind == 2


def test_a_queued_save_names_its_checkpoint_and_no_path_of_the_apis_host(client, app, auth):
    """The session worker chooses where a checkpoint's files go (under its own data directory): a save's payload
    holds the checkpoint's kind, name and tinker:// path only."""
    headers = _tml(auth)
    model_id, _ = _model(client, headers, _session(client, headers))
    routes = (("save_weights", "training", "weights"), ("save_weights_for_sampler", "sampler", "sampler_weights"))
    for route, kind, segment in routes:
        r = client.post(f"/api/v1/{route}", json={"model_id": model_id, "path": "s-1"}, headers=headers)
        assert r.status_code == 200, r.text
        with app.state.db.read_session() as s:
            payload = s.get(TinkerRequest, r.json()["request_id"]).payload
        assert payload == {"kind": kind, "name": "s-1", "path": f"tinker://{model_id}/{segment}/s-1"}


def test_bad_requests_name_their_field(client, auth, other_auth):
    headers = _tml(auth)
    assert (
        client.post("/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": "tml-nope"}).status_code == 401
    )
    session_id = _session(client, headers)
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": "../etc", "lora_config": {"rank": 2}}
    r = client.post("/api/v1/create_model", json=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["field"] == "base_model"
    model_id, _ = _model(client, headers, session_id)
    r = client.post("/api/v1/get_info", json={"model_id": model_id}, headers=_tml(other_auth))
    assert r.status_code == 404
    fb = {
        "model_id": model_id,
        "forward_backward_input": {
            "loss_fn": "nope",
            "data": [{"model_input": {"chunks": [{"tokens": [1, 2]}]}, "loss_fn_inputs": {"target_tokens": [2, 3]}}],
        },
    }
    r = client.post("/api/v1/forward_backward", json=fb, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["field"] == "loss_fn"
    fb["forward_backward_input"]["loss_fn"] = "cross_entropy"
    fb["forward_backward_input"]["data"][0]["loss_fn_inputs"]["target_tokens"] = [2]
    r = client.post("/api/v1/forward_backward", json=fb, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["field"] == "data[0]"
    r = client.post(
        "/api/v1/load_weights", json={"model_id": model_id, "path": "s3://x", "optimizer": False}, headers=headers
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "path"

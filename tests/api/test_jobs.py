"""/v1/jobs: submit-time checks naming the field, idempotency, listing, cancel, limits."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from store.models import Job
from tests.api.conftest import job_body


def count_jobs(app) -> int:
    with app.state.db.session() as s:
        return s.scalar(select(func.count()).select_from(Job))


def test_create_get_list_cancel(client, auth, uploaded, model_name):
    r = client.post(
        "/v1/jobs",
        json={**job_body(uploaded["id"]), "name": "first", "metadata": {"team": "rl"}, "seed": 7},
        headers=auth,
    )
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "queued" and job["queue_position"] >= 1 and job["total_steps"] == 2
    assert job["hyperparameters"]["clip_eps_low"] == 3e-4 and job["hyperparameters"]["seed"] == 7
    assert job["model"] == "toy" and job["metadata"] == {"team": "rl"}
    got = client.get(f"/v1/jobs/{job['id']}", headers=auth).json()
    assert got["id"] == job["id"] and got["latest_metrics"] is None
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth).json()
    assert cancelled["status"] == "cancelled" and cancelled["queue_position"] is None
    assert client.get("/v1/jobs?status=cancelled", headers=auth).json()["data"][0]["id"] == job["id"]
    assert client.get("/v1/jobs?status=queued", headers=auth).json()["data"] == []


def test_cursor_pagination(client, auth, uploaded, model_name, settings):
    ids = []
    for _ in range(3):
        ids.append(client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"])
        client.post(f"/v1/jobs/{ids[-1]}/cancel", headers=auth)
    page1 = client.get("/v1/jobs?limit=2", headers=auth).json()
    page2 = client.get(f"/v1/jobs?limit=2&cursor={page1['next_cursor']}", headers=auth).json()
    assert len(page1["data"]) == 2 and len(page2["data"]) == 1 and page2["next_cursor"] is None
    assert sorted(j["id"] for j in page1["data"] + page2["data"]) == sorted(ids)
    assert client.get("/v1/jobs?cursor=garbage", headers=auth).status_code == 400


def test_idempotency_key_returns_the_same_job(client, app, auth, uploaded, model_name):
    h = {**auth, "Idempotency-Key": "abc-123"}
    a = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=h)
    b = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=h)
    assert a.status_code == 201 and b.status_code == 200 and a.json()["id"] == b.json()["id"]
    # The same request spelled differently (a default written out) is still the same request.
    c = client.post("/v1/jobs", json=job_body(uploaded["id"], clip_eps_low=3e-4), headers=h)
    assert c.status_code == 200 and c.json()["id"] == a.json()["id"]
    assert count_jobs(app) == 1


@pytest.mark.parametrize(
    "patch",
    [
        {"hyperparameters": {"steps": 3, "group_size": 4, "prompts_per_step": 2}},
        {"seed": 5},
        {"name": "other"},
        {"model": "ckpt:nope"},
        {"reward": {"type": "math_answer", "reference": "{{item.answer}}"}},
    ],
)
def test_idempotency_key_reused_for_a_different_job_is_refused(client, app, auth, uploaded, model_name, patch):
    h = {**auth, "Idempotency-Key": "abc-456"}
    a = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=h)
    b = client.post("/v1/jobs", json={**job_body(uploaded["id"]), **patch}, headers=h)
    assert a.status_code == 201 and b.status_code == 422, b.text
    err = b.json()["error"]
    assert (
        err["type"] == "idempotency_key_reused"
        and err["field"] == "Idempotency-Key"
        and a.json()["id"] in err["message"]
    )
    assert count_jobs(app) == 1


def test_grader_credentials_are_never_read_back(client, app, auth, uploaded, model_name):
    judge = {
        "type": "score_model",
        "name": "judge",
        "base_url": "http://judge.invalid/v1",
        "model": "m",
        "api_key": "sk-live-1234",
        "input": [{"role": "user", "content": "{{sample.output_text}}"}],
    }
    hook = {
        "type": "http",
        "name": "hook",
        "url": "http://rm.invalid/score",
        "headers": {"Authorization": "Bearer tok-5678", "X-Team": "rl"},
    }
    spec = {"type": "multi", "graders": {"judge": judge, "hook": hook}, "calculate_output": "judge + hook"}
    r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "reward": spec}, headers=auth)
    assert r.status_code == 201, r.text
    for body in (
        r.text,
        client.get(f"/v1/jobs/{r.json()['id']}", headers=auth).text,
        client.get("/v1/jobs", headers=auth).text,
    ):
        assert "sk-live-1234" not in body and "tok-5678" not in body
    got = client.get(f"/v1/jobs/{r.json()['id']}", headers=auth).json()["reward"]["graders"]
    assert got["judge"]["api_key"] == "[redacted]" and got["hook"]["headers"] == {
        "Authorization": "[redacted]",
        "X-Team": "[redacted]",
    }
    assert got["judge"]["base_url"] == judge["base_url"] and got["hook"]["url"] == hook["url"]
    with app.state.db.session() as s:  # the worker still gets the credentials it needs
        assert s.get(Job, r.json()["id"]).reward["graders"]["judge"]["api_key"] == "sk-live-1234"
    tool = {**hook, "url": None, "server_url": "http://tool.invalid/f", "parameters": {"type": "object"}}
    del tool["url"]
    r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "tools": [tool]}, headers=auth)
    assert r.status_code == 201, r.text
    assert "tok-5678" not in r.text and r.json()["tools"][0]["headers"]["Authorization"] == "[redacted]"
    with app.state.db.session() as s:
        assert s.get(Job, r.json()["id"]).tools[0]["headers"]["Authorization"] == "Bearer tok-5678"
    agent = {"type": "agent", "server_url": "http://agent.invalid/run", "headers": hook["headers"]}
    r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "tools": [agent]}, headers=auth)
    assert r.status_code == 201, r.text
    assert "tok-5678" not in r.text and r.json()["tools"][0]["headers"]["Authorization"] == "[redacted]"


def test_url_userinfo_is_never_read_back(client, app, auth, uploaded, model_name):
    """Credentials in a URL's userinfo (graders, judges, tools, webhooks) are redacted wherever the URL is
    shown back, native and OpenAI views alike; the worker still gets them."""
    judge = {
        "type": "score_model",
        "name": "judge",
        "base_url": "http://judge-user:pw-judge-1@judge.invalid/v1",
        "model": "m",
        "input": [{"role": "user", "content": "{{sample.output_text}}"}],
    }
    hook = {"type": "http", "name": "hook", "url": "https://hook-user:pw-hook-2@rm.invalid/score"}
    spec = {"type": "multi", "graders": {"judge": judge, "hook": hook}, "calculate_output": "judge + hook"}
    tool = {"type": "http", "name": "t", "server_url": "https://tool:pw-tool-3@tool.invalid/f"}
    tool["parameters"] = {"type": "object"}
    r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "reward": spec, "tools": [tool]}, headers=auth)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    hooked = client.post("/v1/webhooks", json={"url": "https://wh-user:pw-hook-4@example.com/h"}, headers=auth)
    assert hooked.status_code == 201, hooked.text
    shown = [r.text, hooked.text]
    for path in (f"/v1/jobs/{job_id}", "/v1/jobs", f"/v1/fine_tuning/jobs/{job_id}", "/v1/webhooks"):
        shown.append(client.get(path, headers=auth).text)
    shown.append(client.get("/v1/webhook_endpoints", headers=auth).text)
    for body in shown:
        assert "pw-" not in body and "-user" not in body, body
    got = client.get(f"/v1/jobs/{job_id}", headers=auth).json()
    assert got["reward"]["graders"]["judge"]["base_url"] == "http://[redacted]@judge.invalid/v1"
    assert got["tools"][0]["server_url"] == "https://[redacted]@tool.invalid/f"
    assert client.get("/v1/webhooks", headers=auth).json()["data"][0]["url"] == "https://[redacted]@example.com/h"
    with app.state.db.session() as s:
        assert s.get(Job, job_id).reward["graders"]["hook"]["url"] == hook["url"]


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"hyperparameters": {"group_size": 1}}, "hyperparameters.group_size"),
        ({"hyperparameters": {"learning_rate": -1}}, "hyperparameters.learning_rate"),
        ({"hyperparameters": {"warp_speed": 9}}, "hyperparameters.warp_speed"),
        ({"hyperparameters": {"prompts_per_step": 3, "group_size": 3, "mini_batches": 4}}, "hyperparameters"),
        ({"reward": {"type": "nope"}}, "reward.type"),
        ({"reward": {"type": "string_check", "reference": "{{item.missing}}", "operation": "eq"}}, "reward"),
        ({"model": "../../etc"}, "model"),
        ({"model": "/etc"}, "model"),
        ({"model": "not a model!"}, "model"),
        ({"model": "ckpt:ckpt_doesnotexist"}, "model"),
        ({"training_file": "file_nope"}, "training_file"),
        ({"validation_file": "file_nope"}, "validation_file"),
        ({"surprise": 1}, "surprise"),
        ({"tools": [{"type": "nope"}]}, "tools[0].type"),
        ({"tools": [{"type": "mcp", "server_url": "http://127.0.0.1:1/mcp"}]}, "tools[0].server_url"),
        (
            {"tools": [{"type": "mcp", "server_url": "http://x.invalid/mcp", "allowed_tools": [1]}]},
            "tools[0].allowed_tools",
        ),
        ({"tools": [{"type": "http", "name": "f", "server_url": "http://127.0.0.1:1/x"}]}, "tools[0].server_url"),
        ({"tools": [{"type": "python", "source": "def f(x):\n    return x\n"}]}, "tools[0].source"),
    ],
)
def test_bad_jobs_are_refused_naming_the_field(client, app, auth, uploaded, model_name, patch, field):
    body = {**job_body(uploaded["id"]), **patch}
    if "hyperparameters" in patch:
        body["hyperparameters"] = patch["hyperparameters"]
    r = client.post("/v1/jobs", json=body, headers=auth)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["field"] == field, r.json()
    assert count_jobs(app) == 0


def test_hub_ids_are_accepted_when_allowed(client, auth, uploaded):
    r = client.post("/v1/jobs", json=job_body(uploaded["id"], model="Qwen/Qwen2.5-0.5B-Instruct"), headers=auth)
    assert r.status_code == 201


def test_per_tenant_active_job_cap(client, auth, other_auth, uploaded, model_name, toy_dataset):
    for _ in range(3):
        assert client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).status_code == 201
    r = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth)
    assert r.status_code == 429 and r.json()["error"]["type"] == "too_many_jobs"
    other = client.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=other_auth).json()
    assert client.post("/v1/jobs", json=job_body(other["id"]), headers=other_auth).status_code == 201


def test_request_body_limit(client, auth):
    r = client.post(
        "/v1/jobs", content=b"{" + b" " * 2_000_000 + b"}", headers={**auth, "Content-Type": "application/json"}
    )
    assert r.status_code == 413


def test_concurrent_retries_with_one_idempotency_key_make_one_job(client, app, auth, uploaded, model_name):
    from concurrent.futures import ThreadPoolExecutor

    h = {**auth, "Idempotency-Key": "race-1"}
    with ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda _: client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=h), range(6)))
    assert all(r.status_code in (200, 201) for r in rs), [r.text for r in rs]
    assert len({r.json()["id"] for r in rs}) == 1 and [r.status_code for r in rs].count(201) == 1
    assert count_jobs(app) == 1

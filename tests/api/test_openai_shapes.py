"""OpenAI's shapes over native jobs, on SQLite and PostgreSQL (no worker): the job object, events and list
cursors, metadata filters, and the error bodies of /v1/fine_tuning and /v1/files."""

from __future__ import annotations

from tests.api.conftest import job_body


def _native_job(client, auth, file_id: str, **metadata: str) -> str:
    r = client.post("/v1/jobs", json={**job_body(file_id), "metadata": metadata, "name": "n"}, headers=auth)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_native_jobs_in_openai_shapes(client, auth, uploaded, model_name):
    ids = [_native_job(client, auth, uploaded["id"], team=team) for team in ("a", "b", "a")]
    job = client.get(f"/v1/fine_tuning/jobs/{ids[0]}", headers=auth).json()
    assert job["object"] == "fine_tuning.job" and job["status"] == "queued" and job["suffix"] == "n"
    assert isinstance(job["created_at"], int) and job["fine_tuned_model"] is None and job["error"] is None
    hp = job["method"]["reinforcement"]["hyperparameters"]
    assert (hp["batch_size"], hp["compute_multiplier"], hp["n_epochs"]) == (2, 0.5, 1)  # 2 x 2 of 16 rows: 1 pass begun
    page = client.get("/v1/fine_tuning/jobs?limit=2", headers=auth).json()
    assert [j["id"] for j in page["data"]] == ids[:0:-1] and page["has_more"]
    rest = client.get(f"/v1/fine_tuning/jobs?limit=2&after={page['last_id']}", headers=auth).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and not rest["has_more"]
    team_a = client.get("/v1/fine_tuning/jobs?metadata[team]=a&limit=1", headers=auth).json()
    assert [j["id"] for j in team_a["data"]] == [ids[2]] and team_a["has_more"]
    events = client.get(f"/v1/fine_tuning/jobs/{ids[0]}/events", headers=auth).json()
    assert [(e["type"], e["data"]["kind"]) for e in events["data"]] == [("message", "status")]
    after = client.get(f"/v1/fine_tuning/jobs/{ids[0]}/events?after={events['data'][0]['id']}", headers=auth).json()
    assert after["data"] == [] and not after["has_more"]
    cancelled = client.post(f"/v1/fine_tuning/jobs/{ids[0]}/cancel", headers=auth).json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] >= cancelled["created_at"]
    assert client.get(f"/v1/jobs/{ids[0]}", headers=auth).json()["status"] == "cancelled"


def test_error_bodies(client, auth, other_auth, uploaded, model_name):
    r = client.post("/v1/fine_tuning/jobs", json={"model": "toy", "training_file": 5}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "training_file"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.get("/v1/fine_tuning/jobs", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    job = _native_job(client, auth, uploaded["id"])
    r = client.get(f"/v1/fine_tuning/jobs/{job}", headers=other_auth)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = client.get(f"/v1/fine_tuning/jobs/{job}/events?after=ftevent-e999999", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"
    r = client.post(f"/v1/fine_tuning/jobs/{job}/pause", headers=auth)  # a queued job pauses at once
    assert r.status_code == 200 and r.json()["status"] == r.json()["gspo_status"] == "paused"
    cancelled = client.post(f"/v1/fine_tuning/jobs/{job}/cancel", headers=auth).json()
    assert cancelled["gspo_status"] == "cancelled" and len(cancelled["result_files"]) == 1
    r = client.post(f"/v1/fine_tuning/jobs/{job}/resume", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_status" and "cancelled" in r.text
    r = client.post("/v1/files", files={"file": ("x.jsonl", b"[1]\n")}, headers=auth)
    err = r.json()["error"]
    assert r.status_code == 400 and err["line"] == 1 and err["param"] == err["field"] and err["code"] == err["type"]

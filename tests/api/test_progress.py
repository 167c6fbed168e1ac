"""Metrics (JSON, CSV), events (SSE with Last-Event-ID), samples, checkpoints and their download."""

from __future__ import annotations

import io
import json
import tarfile

from store import jobs, progress
from store.models import Job
from tests.api.conftest import job_body


def test_metrics_json_after_step_and_csv(client, auth, job_with_progress):
    data = client.get(f"/v1/jobs/{job_with_progress}/metrics", headers=auth).json()["data"]
    assert [m["step"] for m in data] == [1, 2, 3] and data[1]["metrics"]["reward/mean"] == 0.2
    after = client.get(f"/v1/jobs/{job_with_progress}/metrics?after_step=2", headers=auth).json()["data"]
    assert [m["step"] for m in after] == [3]
    csv = client.get(f"/v1/jobs/{job_with_progress}/metrics?format=csv", headers=auth).text.splitlines()
    assert csv[0] == "step,loss,reward/mean" and csv[3] == "3,-3,0.3"
    job = client.get(f"/v1/jobs/{job_with_progress}", headers=auth).json()
    assert job["status"] == "succeeded" and job["step"] == 3 and job["latest_metrics"]["reward/mean"] == 0.3


def parse_sse(text: str) -> list[tuple[str, str, dict]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "data" in fields:
            out.append((fields.get("event", "message"), fields.get("id", ""), json.loads(fields["data"])))
    return out


def test_events_stream_and_resume(client, auth, job_with_progress):
    events = parse_sse(client.get(f"/v1/jobs/{job_with_progress}/events", headers=auth).text)
    kinds = [e for e, _, _ in events]
    assert kinds.count("metrics") == 3 and kinds[-1] == "end" and "checkpoint" in kinds
    statuses = [d["data"]["status"] for e, _, d in events if e == "status"]
    assert statuses == ["queued", "running", "succeeded"]
    mid = next(i for e, i, d in events if e == "metrics" and d["step"] == 2)
    resumed = parse_sse(client.get(f"/v1/jobs/{job_with_progress}/events", headers={**auth, "Last-Event-ID": mid}).text)
    assert [d["step"] for e, _, d in resumed if e == "metrics"] == [3]


def test_samples(client, auth, job_with_progress):
    latest = client.get(f"/v1/jobs/{job_with_progress}/samples", headers=auth).json()
    assert latest["step"] == 3 and latest["steps_available"] == [1, 2, 3]
    assert latest["rows"][0]["completions"][0]["scores"] == {"m": 0.5}
    assert client.get(f"/v1/jobs/{job_with_progress}/samples?step=1", headers=auth).json()["step"] == 1
    assert client.get(f"/v1/jobs/{job_with_progress}/samples?step=9", headers=auth).status_code == 404
    # Past any job's last step: a 422 naming the parameter (it was a database overflow, a 500, on SQLite).
    for url in ("samples?step=9734114785686062727", "metrics?after_step=9734114785686062727"):
        r = client.get(f"/v1/jobs/{job_with_progress}/{url}", headers=auth)
        assert r.status_code == 422 and "step" in r.text, r.text


def test_checkpoints_list_and_download(client, auth, job_with_progress):
    ckpts = client.get(f"/v1/jobs/{job_with_progress}/checkpoints", headers=auth).json()["data"]
    assert len(ckpts) == 1 and ckpts[0]["step"] == 3 and ckpts[0]["final"]
    assert ckpts[0]["metrics"]["reward/mean"] == 0.3 and ckpts[0]["size_bytes"] == 5000 + 8 + 5
    r = client.get(f"/v1/checkpoints/{ckpts[0]['id']}/download", headers=auth)
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        names = sorted(tar.getnames())
        total = sum(m.size for m in tar.getmembers())
    root = f"{job_with_progress}-step-000003"
    assert names == [f"{root}/model/config.json", f"{root}/model/model.safetensors"]  # no trainer state
    assert int(r.headers["X-Checkpoint-Bytes"]) == total == 5008


def test_new_job_from_checkpoint(client, auth, job_with_progress, uploaded):
    ckpt = client.get(f"/v1/jobs/{job_with_progress}/checkpoints", headers=auth).json()["data"][0]
    r = client.post("/v1/jobs", json=job_body(uploaded["id"], model=f"ckpt:{ckpt['id']}"), headers=auth)
    assert r.status_code == 201 and r.json()["model"] == f"ckpt:{ckpt['id']}"


def test_rewards_run(client, auth):
    spec = {
        "type": "multi",
        "graders": {
            "c": {"type": "string_check", "reference": "{{item.answer}}", "operation": "eq"},
            "boom": {"type": "python", "source": "def grade(sample, item):\n    raise RuntimeError('x')"},
        },
    }
    r = client.post(
        "/v1/rewards/run", json={"reward": spec, "item": {"answer": "a"}, "samples": ["a", "b"]}, headers=auth
    )
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert res[0]["scores"]["c"] == 1.0 and res[1]["scores"]["c"] == 0.0
    assert res[0]["errors"]["boom"].startswith("exception")
    bad = client.post("/v1/rewards/run", json={"reward": {"type": "regex"}, "samples": ["a"]}, headers=auth)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "reward.pattern"


def test_health_ready_prometheus(client, app, settings, auth):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    expected = {"database": "ok", "broker": "ok", "sandbox": "bubblewrap", "worker": "missing", "workers": 0}
    assert ready.status_code == 200 and ready.json() == expected  # no worker runs here: reported, not a 503
    assert client.get("/metrics").status_code == 404  # off until the operator sets a token
    app.state.settings = settings.model_copy(update={"metrics_token": "scrape-me"})
    for headers in ({}, auth, {"Authorization": "Bearer scrape-m"}):  # a tenant's key is not the token
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", headers
    text = client.get("/metrics", headers={"Authorization": "Bearer scrape-me"}).text
    assert "gspo_http_requests_total" in text and 'gspo_jobs{status="queued"}' in text


def test_events_follow_a_running_job_live(client, app, auth, uploaded, model_name):
    """The stream is opened while the job is queued; steps and status changes written meanwhile
    (as the worker writes them) arrive in order, each once, and the stream ends at the terminal status."""
    import threading
    import time

    job_id = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]

    def work() -> None:
        time.sleep(0.7)
        with app.state.db.session() as s:
            jobs.claim(s, job_id, "w1", 30)
        for step in (1, 2, 3):
            time.sleep(0.3)
            with app.state.db.session() as s:
                progress.record_step(s, job_id, step, {"reward/mean": step / 10})
                jobs.add_event(s, job_id, "log", f"step {step} done")
        with app.state.db.session() as s:
            jobs.transition(s, s.get(Job, job_id), "failed", error="out of memory")

    writer = threading.Thread(target=work)
    writer.start()
    events = parse_sse(client.get(f"/v1/jobs/{job_id}/events", headers=auth).text)
    writer.join()
    assert [d["step"] for e, _, d in events if e == "metrics"] == [1, 2, 3]
    assert [d["message"] for e, _, d in events if e == "log" and d["message"].startswith("step")] == [
        "step 1 done",
        "step 2 done",
        "step 3 done",
    ]
    assert [d["data"]["status"] for e, _, d in events if e == "status"] == ["queued", "running", "failed"]
    assert events[-1][0] == "end" and events[-1][2] == {"status": "failed", "step": 3}
    ids = [i for _, i, _ in events]
    # Every frame advances its id (so Last-Event-ID resumes exactly); only the closing `end` repeats one.
    assert len(set(ids[:-1])) == len(ids) - 1 and ids[-1] == ids[-2]
    assert client.get(f"/v1/jobs/{job_id}", headers=auth).json()["error"] == "out of memory"


def test_get_one_checkpoint(client, auth, job_with_progress):
    listed = client.get(f"/v1/jobs/{job_with_progress}/checkpoints", headers=auth).json()["data"][0]
    one = client.get(f"/v1/checkpoints/{listed['id']}", headers=auth)
    assert one.status_code == 200 and one.json() == listed
    assert one.json()["download_url"].endswith(f"/v1/checkpoints/{listed['id']}/download")

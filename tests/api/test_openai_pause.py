"""Pause, resume and results files through the official `openai` SDK, against the live `gspo api` and worker."""

from __future__ import annotations

import csv
import io
import time

import openai
import pytest

from gspo_client import ApiError, Client
from tests.api.test_openai_sdk import rl_method, sdk, upload

STEPS = 8


def _until(client: openai.OpenAI, job_id: str, done, tmp, timeout: float = 300.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while not done(job := client.fine_tuning.jobs.retrieve(job_id)):
        assert time.monotonic() < deadline, (job, (tmp / "worker.log").read_text()[-3000:])
        time.sleep(every)
    return job


def _csv(client: openai.OpenAI, job) -> list[dict]:
    assert len(job.result_files) == 1
    f = client.files.retrieve(job.result_files[0])
    assert f.purpose == "fine-tune-results" and f.filename == "step_metrics.csv"
    return list(csv.DictReader(io.StringIO(client.files.content(f.id).text)))


def test_pause_resume_cancel_and_results_files(service):
    url, keys, tmp = service
    client = sdk(service)
    file_id = upload(client, tmp)
    job = client.fine_tuning.jobs.create(model="toy", training_file=file_id, method=rl_method(steps=STEPS))
    _until(client, job.id, lambda j: j.step >= 1 or j.status in ("succeeded", "failed"), tmp)

    # While the only worker slot is busy, a second job waits queued: it pauses at once and is not started.
    queued = client.fine_tuning.jobs.create(model="toy", training_file=file_id, method=rl_method(steps=1))
    paused = client.fine_tuning.jobs.pause(queued.id)
    assert (paused.status, paused.gspo_status, paused.finished_at) == ("paused", "paused", None)

    asked = client.fine_tuning.jobs.pause(job.id)
    assert asked.status == "paused" and asked.gspo_status in ("pausing", "paused"), asked
    job = _until(client, job.id, lambda j: j.gspo_status != "pausing", tmp)
    assert job.status == "paused" and 1 <= job.step < STEPS and job.finished_at is None, job
    assert job.step in [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id)]
    messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "message"]
    assert any(m.startswith(f"paused at step {job.step}") for m in messages), messages

    time.sleep(1.0)  # the freed worker takes nothing: the other job is paused
    assert client.fine_tuning.jobs.retrieve(queued.id).gspo_status == "paused"
    cancelled = client.fine_tuning.jobs.cancel(queued.id)
    assert (cancelled.status, cancelled.gspo_status) == ("cancelled", "cancelled") and cancelled.finished_at
    assert _csv(client, cancelled) == [], "a job that ran no step has an empty metrics CSV"
    with pytest.raises(ApiError) as exc:  # the native client and route: 409 naming the status
        Client(url, keys[0]).pause_job(queued.id)
    assert exc.value.status == 409 and "cancelled" in str(exc.value)

    resumed = client.fine_tuning.jobs.resume(job.id)
    assert resumed.status in ("queued", "running") and resumed.result_files == []
    job = _until(client, job.id, lambda j: j.status in ("succeeded", "failed", "cancelled"), tmp, every=0.5)
    assert job.status == "succeeded" and job.step == STEPS, job
    metrics = {
        e.data["step"]: e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"
    }
    assert sorted(metrics) == list(range(1, STEPS + 1)), "every step's metrics once, numbered on from the pause"
    rows = _csv(client, job)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert float(r["train_mean_reward"]) == metrics[int(r["step"])]["train_mean_reward"]
        assert float(r["reward/mean"]) == float(r["train_mean_reward"])
    assert client.fine_tuning.jobs.retrieve(job.id).result_files == job.result_files, "made once"

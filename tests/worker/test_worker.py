"""The worker over real Redis, PostgreSQL and Celery processes: success, duplicates, crashes, shutdown."""

from __future__ import annotations

import signal
from datetime import timedelta

import psutil

from gspo_core.toy import build_tiny_reward_model
from store import jobs
from store.models import Job, JobEvent
from tests.worker.conftest import wait_for
from worker.reaper import reap_once


def test_job_runs_to_success(rig):
    rig.start_worker()
    job_id = rig.submit(steps=4, slow=False, save_every=2)
    job = rig.wait_status(job_id, {"succeeded", "failed"}, timeout=120)
    assert job["status"] == "succeeded", (job, rig.logs())
    assert rig.steps(job_id) == [1, 2, 3, 4]
    ckpts = rig.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=rig.h).json()["data"]
    assert [c["step"] for c in ckpts] == [2, 4] and ckpts[-1]["final"]
    assert job["attempts"] == 1 and job["latest_metrics"]["step"] == 4
    # A later job starts from that checkpoint's weights (`ckpt:<id>`, fetched from object storage),
    # graded by a reward model named like the policy model: a directory under the models directory.
    build_tiny_reward_model(rig.settings.models_dir / "rm")
    reward = {
        "type": "multi",
        "graders": {"fmt": {"type": "regex", "pattern": "a"}, "rm": {"type": "reward_model", "model": "rm"}},
    }
    r = rig.client.post(
        "/v1/jobs",
        headers=rig.h,
        json={
            "model": f"ckpt:{ckpts[-1]['id']}",
            "training_file": rig.file_id,
            "reward": reward,
            "hyperparameters": {"steps": 1, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        },
    )
    assert r.status_code == 201, r.text
    job = rig.wait_status(r.json()["id"], {"succeeded", "failed"}, timeout=120)
    assert job["status"] == "succeeded", (job, rig.logs())
    rows = rig.client.get(f"/v1/jobs/{job['id']}/samples", headers=rig.h).json()["rows"]
    comps = [c for row in rows for c in row["completions"]]
    assert comps and all(not c["errors"] and 0 < c["scores"]["rm"] < 1 for c in comps), comps


def test_duplicate_delivery_does_not_train_twice(rig):
    from store.queue import enqueue_run_job

    rig.start_worker()
    rig.start_worker()
    job_id = rig.submit(steps=6)
    enqueue_run_job(rig.settings, job_id)  # a second delivery of the same task, to the other worker
    job = rig.wait_status(job_id, {"succeeded", "failed"}, timeout=150)
    assert job["status"] == "succeeded", rig.logs()
    assert job["attempts"] == 1, "the duplicate must find the live lease and leave"
    assert rig.steps(job_id) == list(range(1, 7))
    assert "skipped" in rig.logs() or rig.logs().count("succeeded") >= 1


def _assert_resumed(rig, job_id: str, steps: int) -> None:
    job = rig.wait_status(job_id, {"succeeded", "failed"}, timeout=180)
    assert job["status"] == "succeeded", rig.logs()
    assert rig.steps(job_id) == list(range(1, steps + 1)), "no step lost or duplicated"
    assert job["attempts"] == 2
    with rig.app.state.db.session() as s:
        msgs = [e.message for e in s.query(JobEvent).filter(JobEvent.job_id == job_id)]
    assert any(m.startswith("resumed from step-") for m in msgs), msgs
    ckpts = rig.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=rig.h).json()["data"]
    assert ckpts[-1]["step"] == steps and ckpts[-1]["final"]


def test_sigkill_mid_job_resumes_from_last_checkpoint(rig):
    w = rig.start_worker()
    job_id = rig.submit(steps=8, save_every=3)
    wait_for(lambda: len(rig.steps(job_id)) >= 4, 120, "4 steps")  # past the step-3 checkpoint
    rig.kill_worker(w)  # the whole worker (main process and job process) dies, as with a lost machine
    rig.start_worker()  # its reaper sees the stale lease, requeues, and it takes the job over
    _assert_resumed(rig, job_id, 8)


def test_killed_job_process_is_replaced_and_resumes(rig):
    w = rig.start_worker()
    job_id = rig.submit(steps=8, save_every=3)
    wait_for(lambda: len(rig.steps(job_id)) >= 4, 120, "4 steps")
    (child,) = psutil.Process(w.pid).children()
    child.kill()  # the kernel's OOM killer picks the big training process, not Celery's main process
    _assert_resumed(rig, job_id, 8)
    assert w.poll() is None, "the worker itself survived"


def test_graceful_sigterm_checkpoints_and_requeues(rig):
    w = rig.start_worker()
    job_id = rig.submit(steps=8)  # 5 steps left when asked to stop: it stops before the end
    wait_for(lambda: len(rig.steps(job_id)) >= 3, 120, "3 steps")
    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0, rig.logs()
    job = rig.job(job_id)
    assert job["status"] == "queued", job
    done = len(rig.steps(job_id))
    ckpts = rig.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=rig.h).json()["data"]
    assert ckpts and ckpts[-1]["step"] == done
    rig.start_worker()
    job = rig.wait_status(job_id, {"succeeded", "failed"}, timeout=150)
    assert job["status"] == "succeeded" and rig.steps(job_id) == list(range(1, 9))
    assert job["attempts"] == 1, "a graceful stop is not a failed attempt"


def test_cancel_is_seen_within_one_step(rig):
    rig.start_worker()
    job_id = rig.submit(steps=200)
    wait_for(lambda: len(rig.steps(job_id)) >= 2, 120, "2 steps")
    at_cancel = len(rig.steps(job_id))
    assert rig.client.post(f"/v1/jobs/{job_id}/cancel", headers=rig.h).json()["status"] == "cancelling"
    job = rig.wait_status(job_id, {"cancelled"}, timeout=30)
    assert job["step"] <= at_cancel + 2


def test_a_worker_whose_job_was_taken_over_stops_writing_at_once(rig):
    rig.start_worker()
    job_id = rig.submit(steps=200)
    wait_for(lambda: len(rig.steps(job_id)) >= 2, 120, "2 steps")
    with rig.app.state.db.session() as s:  # what a successor's claim does after this worker stalled
        job = s.get(Job, job_id)
        job.worker_id, job.lease_until = "successor", jobs._now() + timedelta(minutes=10)
    at = rig.steps(job_id)
    wait_for(lambda: "'lease_lost'" in rig.logs(), 60, "the worker to give the job up")
    assert rig.steps(job_id) == at, "not one step written after the takeover"
    job = rig.db_job(job_id)
    assert (job.status, job.worker_id, job.error) == ("running", "successor", None)


def test_reaper_fails_jobs_past_their_retry_budget(rig):
    job_id = rig.submit(steps=3)
    with rig.app.state.db.session() as s:
        job = jobs.claim(s, job_id, "dead-worker", lease_seconds=-1)  # a lease that is already stale
        job.attempts = job.max_attempts
    requeued, failed = reap_once(rig.settings)
    assert failed == [job_id] and requeued == []
    job = rig.job(job_id)
    assert job["status"] == "failed" and "retry budget" in job["error"]


def test_bad_model_fails_with_an_actionable_message(rig):
    rig.start_worker()
    r = rig.client.post(
        "/v1/jobs",
        headers=rig.h,
        json={
            "model": "nobody/no-such-model",
            "training_file": rig.file_id,
            "reward": {"type": "regex", "pattern": "a"},
            "hyperparameters": {"steps": 1},
        },
    )
    job = rig.wait_status(r.json()["id"], {"failed", "succeeded"}, timeout=120)
    assert job["status"] == "failed" and "nobody/no-such-model" in job["error"], job

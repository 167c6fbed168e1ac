"""Fair turns, device-time limits, budgets and usage, with real Celery workers over Redis and PostgreSQL."""

from __future__ import annotations

import signal
import time
from datetime import datetime

import pytest
from sqlalchemy import select

from gspo_core.toy import TOY_REWARD
from store import jobs
from store.models import Checkpoint, JobEvent, StepMetric, UsageRecord
from store.tenants import authenticate
from store.usage import QueuePolicy
from tests.worker.conftest import wait_for


def ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def step_tokens(rig, job_ids: list[str]) -> tuple[int, int]:
    """Tokens sampled and trained of the steps the jobs recorded."""
    with rig.app.state.db.session() as s:
        rows = list(s.scalars(select(StepMetric.metrics).where(StepMetric.job_id.in_(job_ids))))
    return int(sum(m["tokens/sampled"] for m in rows)), int(sum(m["tokens/trained"] for m in rows))


def test_a_tenant_that_queued_later_runs_before_the_first_tenants_backlog(make_rig):
    rig = make_rig(GSPO_MAX_JOB_DEVICES="2")  # the workers have 1 device (GSPO_WORKER_DEVICES's default)
    body = {"model": "toy", "training_file": rig.file_id, "reward": TOY_REWARD, "resources": {"devices": 3}}
    too_many = rig.client.post("/v1/jobs", json=body, headers=rig.h)
    assert too_many.status_code == 422 and too_many.json()["error"]["field"] == "resources.devices", too_many.text
    big = rig.submit(steps=2, slow=False, job={"resources": {"devices": 2}})  # A's oldest: no worker can hold it
    a_jobs = [rig.submit(steps=2, slow=False) for _ in range(3)]
    b = rig.add_tenant()
    b_job = rig.submit(steps=2, slow=False, tenant=b)
    assert rig.job(b_job, b[0])["queue_position"] == 1, "B's place counts only B's own jobs"
    rig.start_worker()
    done = rig.wait_status(b_job, {"succeeded", "failed"}, timeout=180, headers=b[0])
    assert done["status"] == "succeeded", rig.logs()
    a_now = [rig.job(j) for j in a_jobs]
    assert a_now[0]["status"] == "succeeded" and ts(a_now[0]["finished_at"]) <= ts(done["started_at"])
    assert all(j["started_at"] is None or ts(j["started_at"]) > ts(done["started_at"]) for j in a_now[1:]), (
        "B ran second, while A still had two jobs queued"
    )
    # B's usage: its device time is the time it held the worker, its tokens those of the steps it ran.
    usage = done["usage"]
    held = ts(done["finished_at"]) - ts(done["started_at"])
    assert 0 < usage["device_seconds"] <= held + 1 and usage["device_seconds"] > held - 3, (usage, held)
    assert (usage["tokens_sampled"], usage["tokens_trained"]) == step_tokens(rig, [b_job])
    assert usage["tokens_sampled"] > 0 and usage["tokens_trained"] > usage["tokens_sampled"]
    total = rig.client.get("/v1/usage", headers=b[0]).json()["total"]
    assert total == {**usage, "jobs": 1}
    waiting = rig.job(big)
    assert waiting["status"] == "queued" and waiting["resources"] == {"devices": 2}, waiting
    assert (waiting["queue_position"], waiting["waiting_reason"]) == (
        1,
        "waiting for a worker with 2 devices (resources.devices); this service's workers have 1",
    )
    rig.start_worker(GSPO_WORKER_DEVICES="2")  # it fits there: two ranks (this worker's job process is rank 0)
    done = rig.wait_status(big, {"succeeded", "failed"}, timeout=180)
    assert done["status"] == "succeeded" and rig.steps(big) == [1, 2], (done, rig.logs())


def test_the_wall_clock_limit_counts_every_run_and_fails_the_job_at_a_step_boundary(make_rig):
    limit = 18  # above a run's start-up and 2 steps (the first run stays under it), short enough to wait out
    rig = make_rig()
    w = rig.start_worker()
    job_id = rig.submit(steps=500, job={"max_wall_seconds": limit})
    wait_for(lambda: len(rig.steps(job_id)) >= 2, 120, "2 steps")
    w.send_signal(signal.SIGTERM)  # a graceful stop: checkpointed and requeued, its device time kept
    assert w.wait(60) == 0, rig.logs()
    first = rig.job(job_id)["usage"]["device_seconds"]
    assert rig.job(job_id)["status"] == "queued" and 0 < first < limit
    rig.start_worker()
    job = rig.wait_status(job_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert job["status"] == "failed", rig.logs()
    assert job["error"].startswith("wall-clock limit reached"), job["error"]
    assert f"{limit} s (the job's max_wall_seconds)" in job["error"]
    steps = rig.steps(job_id)
    assert steps == list(range(1, job["step"] + 1)) and len(steps) > 2, "every completed step's metrics kept"
    with rig.app.state.db.session() as s:
        ckpt = s.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()))
        runs = s.execute(
            select(UsageRecord.run_id, UsageRecord.device_seconds).where(UsageRecord.job_id == job_id)
        ).all()
    assert ckpt == job["step"], "it checkpointed where it stopped"
    assert len({r for r, _ in runs}) == 2 and sum(d for _, d in runs) == pytest.approx(job["usage"]["device_seconds"])
    assert limit <= job["usage"]["device_seconds"] < limit + 25, "stopped at the first step boundary past the limit"
    assert max(d for _, d in runs) < limit, "the second run stopped early: the first run's time counted"


def test_a_tenant_over_its_budget_waits_for_the_next_period_with_the_reason_shown(make_rig):
    period = 10
    rig = make_rig(
        GSPO_TENANT_DEVICE_HOURS_PER_PERIOD="0.01",
        GSPO_BUDGET_PERIOD_SECONDS=str(period),
        GSPO_RESEND_LOST_AFTER_SECONDS="3",
    )
    policy = QueuePolicy.of(rig.settings)
    rig.start_worker()
    wait_for(lambda: " ready." in rig.logs(), 120, "the worker to start")
    if time.time() % period > period - 5:  # leave the checks below time to run within one period
        time.sleep(period - time.time() % period + 0.2)
    with rig.app.state.db.session() as s:  # the tenant's earlier jobs used 40 s of its 36 s this period
        tenant_id = authenticate(s, rig.h["Authorization"].split()[1]).id
        s.add(
            UsageRecord(
                tenant_id=tenant_id,
                job_id="job_earlier",
                run_id="r1",
                attempt=1,
                tokens_sampled=10,
                tokens_trained=20,
                device_seconds=40.0,
                period_start=policy.period_start(jobs._now()),
            )
        )
    job_id = rig.submit(steps=2, slow=False)
    usage = rig.client.get("/v1/usage", headers=rig.h).json()
    end = usage["budget_exhausted_until"]
    assert end and usage["budget_device_hours"] == 0.01 and usage["budget_left_device_hours"] == 0
    assert usage["current"]["device_seconds"] == 40.0 and usage["current"]["tokens_trained"] == 20
    waiting = rig.job(job_id)
    assert waiting["status"] == "queued" and waiting["queue_position"] == 1
    assert waiting["waiting_reason"] == (
        f"tenant device-hour budget used (0.0111 of 0.01 h this period) until {datetime.fromisoformat(end).isoformat()}"
    )
    job = rig.wait_status(job_id, {"succeeded", "failed"}, timeout=period + 120)
    assert job["status"] == "succeeded", rig.logs()
    assert ts(job["started_at"]) >= ts(end), "it started once the next period freed budget"
    assert job["attempts"] == 1
    total = rig.client.get("/v1/usage", headers=rig.h).json()["total"]
    assert total["device_seconds"] == pytest.approx(40.0 + job["usage"]["device_seconds"]) and total["jobs"] == 2


def test_a_running_job_is_paused_when_its_tenant_spends_the_budget_and_resumes_next_period(make_rig):
    period = 15
    rig = make_rig(
        GSPO_TENANT_DEVICE_HOURS_PER_PERIOD="0.001",
        GSPO_BUDGET_PERIOD_SECONDS=str(period),
        GSPO_RESEND_LOST_AFTER_SECONDS="3",
    )
    rig.start_worker()
    wait_for(lambda: " ready." in rig.logs(), 120, "the worker to start")
    if time.time() % period > 3:  # start early in a period: 3.6 s of budget (a step at least), a pause, the next
        time.sleep(period - time.time() % period + 0.2)
    job_id = rig.submit(steps=40)
    paused = wait_for(
        lambda: (j := rig.job(job_id))["status"] == "queued" and j["step"] > 0 and j,
        60,
        "the running job to be paused by the budget",
    )
    assert paused["waiting_reason"].startswith("tenant device-hour budget used"), paused
    assert 0 < paused["step"] < 40 and paused["attempts"] == 0, paused
    with rig.app.state.db.session() as s:
        logs = list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id)))
        assert s.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job_id)) == paused["step"]
    assert any("device-hour budget of this period is used" in m for m in logs), logs
    resumed = wait_for(
        lambda: (j := rig.job(job_id))["step"] > paused["step"] and j,
        period + 60,
        "the job to go on in the next period",
    )
    assert resumed["status"] in ("running", "queued", "succeeded"), resumed
    rig.client.post(f"/v1/jobs/{job_id}/cancel", headers=rig.h)

"""A step that waits on a slow agent does not hold back a wall-clock limit, a tenant's budget, a pause or a
cancel: real Celery workers over Redis and PostgreSQL, a real agent server on loopback that holds its rollouts."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from store import jobs
from store.models import Checkpoint, UsageRecord
from store.tenants import authenticate
from store.usage import QueuePolicy
from tests.worker.conftest import wait_for
from tests.worker.slow_agent import SlowAgent

#: Agents, like any user URL, reach loopback only where the operator allows it.
LOOPBACK = {"GSPO_EGRESS_ALLOW": "127.0.0.1"}
#: From the moment a stop is due to the job's settled status: a poll (1 s), a checkpoint and the settle, on a
#: loaded 2-core machine (today's main waits for the step: the agent's 600 s).
MARGIN_S = 10.0


@pytest.fixture()
def agent():
    server = SlowAgent()
    yield server
    server.close()


def submit(rig, agent, steps: int, job: dict | None = None) -> str:
    return rig.submit(steps=steps, slow=False, job={"tools": [agent.spec()], **(job or {})}, group_size=2)


def ckpt_steps(rig, job_id: str) -> list[int]:
    with rig.app.state.db.session() as s:
        return list(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))


def test_the_wall_clock_limit_stops_a_step_that_waits_on_a_slow_agent(make_rig, agent):
    limit = 40  # above a run's start-up on a loaded machine: the limit falls inside the first step
    rig = make_rig(**LOOPBACK)
    agent.slow.set()  # every rollout is held for 15 minutes (the agent's timeout_s is 600 s)
    rig.start_worker()
    job_id = submit(rig, agent, steps=3, job={"max_wall_seconds": limit})
    job = rig.wait_status(job_id, {"succeeded", "failed", "cancelled"}, timeout=limit + 60)
    assert job["status"] == "failed" and job["error"].startswith("wall-clock limit reached"), (job, rig.logs())
    assert agent.held > 0, "the first step was waiting on the agent (not so when the start-up took the limit)"
    assert limit <= job["usage"]["device_seconds"] < limit + MARGIN_S, job["usage"]
    assert job["step"] == 0 and rig.steps(job_id) == [], "the half-done step was not trained on"
    assert ckpt_steps(rig, job_id) == [0], "it checkpointed where it stopped"


def test_pause_and_cancel_stop_a_step_that_waits_on_a_slow_agent(make_rig, agent):
    rig = make_rig(**LOOPBACK)
    rig.start_worker()
    job_id = submit(rig, agent, steps=50)
    wait_for(lambda: rig.steps(job_id), 120, "a first step")
    agent.slow.set()
    wait_for(lambda: agent.held, 60, "a step waiting on the agent")
    asked = time.monotonic()
    assert rig.client.post(f"/v1/jobs/{job_id}/pause", headers=rig.h).status_code == 200
    paused = rig.wait_status(job_id, {"paused", "failed"}, timeout=60)
    took = time.monotonic() - asked
    assert paused["status"] == "paused" and took < MARGIN_S, (took, paused, rig.logs())
    done = paused["step"]
    assert done >= 1 and rig.steps(job_id) == list(range(1, done + 1)), "the step in flight was dropped"
    assert max(ckpt_steps(rig, job_id)) == done, "the last completed step is checkpointed"

    held = agent.held
    assert rig.client.post(f"/v1/jobs/{job_id}/resume", headers=rig.h).status_code == 200
    wait_for(lambda: agent.held > held, 120, "the resumed run's step waiting on the agent")
    asked = time.monotonic()
    assert rig.client.post(f"/v1/jobs/{job_id}/cancel", headers=rig.h).status_code == 200
    cancelled = rig.wait_status(job_id, {"cancelled", "failed"}, timeout=60)
    took = time.monotonic() - asked
    assert cancelled["status"] == "cancelled" and took < MARGIN_S, (took, cancelled, rig.logs())
    assert cancelled["step"] == done and max(ckpt_steps(rig, job_id)) == done


def test_a_tenants_budget_stops_a_step_that_waits_on_a_slow_agent(make_rig, agent):
    budget_s = 180.0  # 0.05 h a period (an hour: the test ends long before the next one)
    if time.time() % 3600 > 3600 - 150:
        time.sleep(3600 - time.time() % 3600 + 0.5)
    rig = make_rig(
        GSPO_TENANT_DEVICE_HOURS_PER_PERIOD=str(budget_s / 3600), GSPO_BUDGET_PERIOD_SECONDS="3600", **LOOPBACK
    )
    rig.start_worker()
    job_id = submit(rig, agent, steps=50)
    wait_for(lambda: rig.steps(job_id), 120, "a first step")
    agent.slow.set()
    wait_for(lambda: agent.held, 60, "a step waiting on the agent")
    with rig.app.state.db.session() as s:  # the tenant's other jobs leave this one 5 s of the period's budget
        used = rig.client.get("/v1/usage", headers=rig.h).json()["current"]["device_seconds"]
        tenant_id = authenticate(s, rig.h["Authorization"].split()[1]).id
        start = QueuePolicy.of(rig.settings).period_start(jobs._now())
        other = budget_s - used - 5
        s.add(
            UsageRecord(
                tenant_id=tenant_id,
                job_id="job_other",
                run_id="r1",
                attempt=1,
                device_seconds=other,
                period_start=start,
            )
        )
    job = wait_for(lambda: (j := rig.job(job_id))["status"] != "running" and j, 5 + 60, "the budget to stop the job")
    assert job["status"] == "queued" and job["waiting_reason"].startswith("tenant device-hour budget used"), job
    used = rig.client.get("/v1/usage", headers=rig.h).json()["current"]["device_seconds"]
    assert budget_s <= used < budget_s + MARGIN_S, (used, rig.logs())
    assert job["step"] >= 1 and max(ckpt_steps(rig, job_id)) == job["step"], "the last completed step is kept"
    assert rig.client.post(f"/v1/jobs/{job_id}/cancel", headers=rig.h).status_code == 200

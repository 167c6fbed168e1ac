"""A real `celery worker` (its sender thread) delivers a signed `fine_tuning.job.succeeded` to a real receiver."""

from __future__ import annotations

import pytest
from standardwebhooks import Webhook

from tests.webhook_receiver import Receiver
from tests.worker.conftest import wait_for


@pytest.fixture()
def hook_rig(make_rig):
    return make_rig(GSPO_EGRESS_ALLOW="127.0.0.1", GSPO_WEBHOOK_POLL_SECONDS="0.2")


def test_worker_sends_a_signed_event_when_a_job_succeeds(hook_rig):
    rig = hook_rig
    with Receiver((200,)) as receiver:
        r = rig.client.post("/v1/webhooks", json={"url": receiver.url}, headers=rig.h)
        assert r.status_code == 201, r.text
        ep = r.json()
        rig.start_worker()
        job_id = rig.submit(1, slow=False)
        rig.wait_status(job_id, {"succeeded"}, 180)
        wait_for(lambda: receiver.hits, 30, "the delivery\n" + rig.logs())
    headers, body = receiver.hits[0]
    event = Webhook(ep["secret"]).verify(body, headers)
    assert event["type"] == "fine_tuning.job.succeeded" and event["data"] == {"id": job_id}
    deliveries = wait_for(
        lambda: (
            (d := rig.client.get(f"/v1/webhooks/{ep['id']}/deliveries", headers=rig.h).json()["data"])
            and d[0]["status"] == "delivered"
            and d
        ),
        10,
        "the delivery recorded",
    )
    assert deliveries[0]["id"] == headers["webhook-id"] and deliveries[0]["history"][0]["status_code"] == 200

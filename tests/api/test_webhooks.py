"""Webhooks on SQLite and PostgreSQL: registration (egress policy, cap, the secret shown once), tenancy, the
outbox a terminal status writes, and the worker's sender against a real receiver (signatures, retries)."""

from __future__ import annotations

import logging
import threading
import time

import openai
import pytest
from standardwebhooks import Webhook

from store import jobs
from store.models import Job
from store.settings import Settings
from tests.api.conftest import job_body
from tests.api.live import LiveServer
from tests.conftest import empty_database_url
from tests.webhook_receiver import Receiver
from worker.webhooks import make_client, send_due, start_sender_thread

ALL = ["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path):
    return Settings(
        data_dir=tmp_path,
        database_url=empty_database_url(request, tmp_path),
        models_dir=tmp_path / "models",
        egress_allow="127.0.0.1",  # the receivers of these tests; 127.0.0.2 stays refused
        max_webhooks_per_tenant=4,
        webhook_max_attempts=3,
        webhook_retry_base_seconds=0.05,
        webhook_timeout_seconds=5,
    )


def test_register_list_delete_and_tenancy(client, auth, other_auth):
    r = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook"}, headers=auth)
    assert r.status_code == 201, r.text
    ep = r.json()
    assert ep["secret"].startswith("whsec_") and ep["events"] == ALL and ep["object"] == "webhook_endpoint"
    listed = client.get("/v1/webhooks", headers=auth).json()["data"]
    assert [e["id"] for e in listed] == [ep["id"]] and "secret" not in listed[0]
    # Another tenant sees nothing and cannot touch it.
    assert client.get("/v1/webhooks", headers=other_auth).json()["data"] == []
    assert client.delete(f"/v1/webhooks/{ep['id']}", headers=other_auth).status_code == 404
    assert client.get(f"/v1/webhooks/{ep['id']}/deliveries", headers=other_auth).status_code == 404
    assert client.get(f"/v1/webhooks/{ep['id']}/deliveries").status_code == 401
    # The per-tenant cap (4 here): a 409; the other tenant's count is its own.
    for _ in range(3):
        assert client.post("/v1/webhooks", json={"url": "https://example.com/h"}, headers=auth).status_code == 201
    r = client.post("/v1/webhooks", json={"url": "https://example.com/h"}, headers=auth)
    assert r.status_code == 409 and r.json()["error"]["type"] == "too_many_webhooks"
    assert client.post("/v1/webhooks", json={"url": "https://example.com/h"}, headers=other_auth).status_code == 201
    assert client.delete(f"/v1/webhooks/{ep['id']}", headers=auth).status_code == 204
    assert ep["id"] not in [e["id"] for e in client.get("/v1/webhooks", headers=auth).json()["data"]]


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.2:8000/hook",  # loopback, not on the allow-list
        "http://[::1]/hook",
        "http://10.1.2.3/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://2130706434/hook",  # 127.0.0.2 spelled as one number
        "ftp://example.com/hook",
        "not a url",
    ],
)
def test_refused_urls_name_the_field(client, auth, url):
    r = client.post("/v1/webhooks", json={"url": url}, headers=auth)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "url"


def test_unknown_event_is_a_422(client, auth):
    r = client.post("/v1/webhooks", json={"url": "https://example.com/h", "events": ["job.done"]}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["field"].startswith("events")


def _finish(app, job_id: str, status: str) -> None:
    with app.state.db.session() as s:
        jobs.claim(s, job_id, "w1", 30)
    with app.state.db.session() as s:
        jobs.transition(s, s.get(Job, job_id), status, error="boom" if status == "failed" else None)


def _deliveries(client, auth, ep: dict) -> list[dict]:
    r = client.get(f"/v1/webhooks/{ep['id']}/deliveries", headers=auth)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def _send_until_settled(settings, client, auth, eps: list[dict]) -> None:
    http = make_client(settings)
    deadline = time.monotonic() + 30
    try:
        while any(d["status"] == "pending" for ep in eps for d in _deliveries(client, auth, ep)):
            assert time.monotonic() < deadline, "deliveries did not settle"
            send_due(settings, http)
            time.sleep(0.05)
    finally:
        http.close()


def test_terminal_status_is_delivered_signed_with_retries(client, app, settings, auth, uploaded, model_name):
    with Receiver((500, 500, 200)) as flaky, Receiver((503,)) as down, Receiver((404,)) as gone:
        eps = [client.post("/v1/webhooks", json={"url": r.url}, headers=auth).json() for r in (flaky, down, gone)]
        failed_only = client.post(
            "/v1/webhooks", json={"url": flaky.url, "events": ["fine_tuning.job.failed"]}, headers=auth
        ).json()
        job_id = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]
        _finish(app, job_id, "succeeded")
        assert [d["status"] for d in _deliveries(client, auth, eps[0])] == ["pending"]
        assert _deliveries(client, auth, failed_only) == []
        _send_until_settled(settings, client, auth, eps)

        ok, failed, final = (_deliveries(client, auth, ep)[0] for ep in eps)
        assert ok["status"] == "delivered" and ok["attempts"] == 3 and ok["last_error"] is None
        assert [h["status_code"] for h in ok["history"]] == [500, 500, 200] and ok["next_attempt_at"] is None
        assert [h["error"] for h in ok["history"]] == ["HTTP 500", "HTTP 500", None]
        assert failed["status"] == "failed" and failed["attempts"] == 3 and failed["last_status_code"] == 503
        assert final["status"] == "failed" and final["attempts"] == 1  # a 4xx is not retried
        text = client.get(f"/v1/webhooks/{eps[0]['id']}/deliveries", headers=auth).text
        assert "secret remote details" not in text  # the receiver's body never reaches the tenant

        # Every attempt carries the same webhook-id and a signature that verifies with the endpoint's secret.
        assert len(flaky.hits) == 3 and {h["webhook-id"] for h, _ in flaky.hits} == {ok["id"]}
        headers, body = flaky.hits[-1]
        event = Webhook(eps[0]["secret"]).verify(body, headers)
        assert event["id"] == ok["event_id"] and event["id"].startswith("evt_")
        assert event["object"] == "event" and event["type"] == "fine_tuning.job.succeeded"
        assert event["data"] == {"id": job_id} and isinstance(event["created_at"], int)
        with pytest.raises(Exception, match="signature"):
            Webhook(eps[1]["secret"]).verify(body, headers)
        unwrapped = openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=eps[0]["secret"])
        assert type(unwrapped).__name__ == "FineTuningJobSucceededWebhookEvent" and unwrapped.data.id == job_id

    # Deleting the job deletes its deliveries.
    assert client.delete(f"/v1/jobs/{job_id}", headers=auth).status_code == 204
    assert _deliveries(client, auth, eps[0]) == []


def test_cancel_and_failure_events(client, app, auth, uploaded, model_name):
    ep = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/h", "events": ALL[1:]}, headers=auth).json()
    queued = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]
    assert client.post(f"/v1/jobs/{queued}/cancel", headers=auth).status_code == 200
    failed = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]
    _finish(app, failed, "failed")
    got = {(d["job_id"], d["event_type"]) for d in _deliveries(client, auth, ep)}
    assert got == {(queued, "fine_tuning.job.cancelled"), (failed, "fine_tuning.job.failed")}


def test_openai_sdk_manages_endpoints(app, auth, other_auth):
    """The `openai` SDK's `client.webhooks` (create, list, retrieve, delete) against a real server."""
    with LiveServer(app) as live:
        sdk = openai.OpenAI(base_url=live.url + "/v1", api_key=auth["Authorization"][7:], max_retries=0)
        other = openai.OpenAI(base_url=live.url + "/v1", api_key=other_auth["Authorization"][7:], max_retries=0)
        ep = sdk.webhooks.create(name="ci", url="https://example.com/h", event_types=["fine_tuning.job.failed"])
        assert ep.signing_secret.startswith("whsec_") and ep.signing_secret_hint.endswith(ep.signing_secret[-4:])
        assert ep.event_types == ["fine_tuning.job.failed"] and ep.name == "ci"
        assert [e.id for e in sdk.webhooks.list()] == [ep.id]
        assert sdk.webhooks.retrieve(ep.id).url == "https://example.com/h"
        with pytest.raises(openai.NotFoundError):
            other.webhooks.retrieve(ep.id)
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.webhooks.create(name="x", url="http://127.0.0.2/h", event_types=["fine_tuning.job.failed"])
        assert bad.value.param == "url"
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.webhooks.create(name="x", url="https://example.com/h", event_types=["batch.completed"])
        assert bad.value.param == "event_types"
        assert sdk.webhooks.delete(ep.id).deleted is True
        with pytest.raises(openai.NotFoundError):
            sdk.webhooks.retrieve(ep.id)


def test_one_tenants_slow_receivers_do_not_hold_the_others_deliveries(
    client, app, settings, auth, other_auth, uploaded, toy_dataset, model_name
):
    """Tenant A's four endpoints (as many as the sender's threads) each take a second to answer, and its
    deliveries are older; tenant B's is sent on a free thread before A's are done, and A never has more than
    one in flight (on a loaded machine B's may come after A's first answer: the count of A's sent is not
    the property, their concurrency is)."""
    other_file = client.post("/v1/files", files={"file": ("toy.jsonl", toy_dataset)}, headers=other_auth).json()
    with Receiver((200,), delay=1.0) as slow, Receiver((200,)) as fast:
        for _ in range(4):
            assert client.post("/v1/webhooks", json={"url": slow.url}, headers=auth).status_code == 201
        assert client.post("/v1/webhooks", json={"url": fast.url}, headers=other_auth).status_code == 201
        a_job = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]
        b_job = client.post("/v1/jobs", json=job_body(other_file["id"]), headers=other_auth).json()["id"]
        _finish(app, a_job, "succeeded")
        _finish(app, b_job, "succeeded")
        stop = threading.Event()
        thread = start_sender_thread(settings.model_copy(update={"webhook_poll_seconds": 0.05}), stop)
        try:
            deadline = time.monotonic() + 10
            while not fast.hits:
                assert time.monotonic() < deadline, "tenant B's delivery was not sent"
                time.sleep(0.01)
            # A's first may be taken after B's on a loaded machine: the property is that B's did not wait
            # for all four of A's (unfair, the four threads take A's older four first and B's comes fifth).
            assert len(slow.hits) < 4, "tenant B's delivery waited for all of tenant A's"
            # Until two of A's have arrived (on a loaded machine none may have when B's was sent): had the free
            # threads taken A's together, the second would have come while the first was in flight.
            while len(slow.hits) < 2:
                assert time.monotonic() < deadline + 10, "tenant A's deliveries were not sent"
                time.sleep(0.01)
            assert slow.most_at_once == 1, "tenant A had more than one delivery in flight"
        finally:
            stop.set()
            thread.join(10)


def test_openai_sdk_updates_rotates_and_tests_endpoints(app, auth, other_auth):
    """`client.webhooks.update`, `.rotate_secret` (the old secret kept 24 h, or not) and `.test` against a real
    server and a real receiver: the test event is signed like a delivery, by each secret in force."""
    with LiveServer(app) as live, Receiver((200, 503, 200)) as rx:
        sdk = openai.OpenAI(base_url=live.url + "/v1", api_key=auth["Authorization"][7:], max_retries=0)
        other = openai.OpenAI(base_url=live.url + "/v1", api_key=other_auth["Authorization"][7:], max_retries=0)
        ep = sdk.webhooks.create(name="ci", url=rx.url, event_types=["fine_tuning.job.failed"])
        assert sdk.webhooks.update(ep.id, name="ci").updated_at == ep.created_at  # nothing changed
        moved = sdk.webhooks.update(ep.id, name="renamed", event_types=ALL[::-1])
        assert (moved.name, moved.event_types, moved.url) == ("renamed", ALL, rx.url)
        assert moved.updated_at >= ep.created_at and sdk.webhooks.retrieve(ep.id).name == "renamed"
        for change, param in (
            ({"url": "http://127.0.0.2/h"}, "url"),
            ({"event_types": ["batch.failed"]}, "event_types"),
        ):
            with pytest.raises(openai.BadRequestError) as bad:
                sdk.webhooks.update(ep.id, **change)
            assert bad.value.param == param
        for call in (other.webhooks.update, other.webhooks.rotate_secret):
            with pytest.raises(openai.NotFoundError):
                call(ep.id)
        with pytest.raises(openai.NotFoundError):
            other.webhooks.test(ep.id, event_type="fine_tuning.job.failed")
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.webhooks.test(ep.id, event_type="batch.failed")
        assert bad.value.param == "event_type" and not rx.hits

        sent = sdk.webhooks.test(ep.id, event_type="fine_tuning.job.failed")
        assert (sent.status_code, sent.webhook_endpoint_id, sent.object) == (200, ep.id, "webhook_endpoint.test")
        event = Webhook(ep.signing_secret).verify(rx.hits[-1][1], rx.hits[-1][0])
        assert event["type"] == "fine_tuning.job.failed" and event["data"] == {"id": "ftjob_test"}

        kept = sdk.webhooks.rotate_secret(ep.id, keep_old_secret_active_for_24_hours=True)
        assert kept.signing_secret != ep.signing_secret and kept.signing_secret_hint.endswith(kept.signing_secret[-4:])
        assert sdk.webhooks.test(ep.id, event_type="fine_tuning.job.succeeded").status_code == 503
        for secret in (kept.signing_secret, ep.signing_secret):  # either verifies during the 24 h
            Webhook(secret).verify(rx.hits[-1][1], rx.hits[-1][0])
        now = sdk.webhooks.rotate_secret(ep.id)  # the previous one stops at once
        assert sdk.webhooks.test(ep.id, event_type="fine_tuning.job.succeeded").status_code == 200
        Webhook(now.signing_secret).verify(rx.hits[-1][1], rx.hits[-1][0])
        for secret in (kept.signing_secret, ep.signing_secret):
            with pytest.raises(Exception, match="signature"):
                Webhook(secret).verify(rx.hits[-1][1], rx.hits[-1][0])
        assert len(rx.hits) == 3


def test_openai_test_delivery_reports_its_real_outcome(client, auth):
    """`POST /v1/webhook_endpoints/{id}/test` says ``success`` only for a 2xx: a real receiver's 500 and an
    unreachable one (nothing listens on its port any more) are failures with their status code and error."""
    event = {"event_type": "fine_tuning.job.failed"}
    with Receiver((200, 500)) as rx:
        ep = client.post(
            "/v1/webhook_endpoints", json={"url": rx.url, "event_types": ALL, "name": "t"}, headers=auth
        ).json()
        test_url = f"/v1/webhook_endpoints/{ep['id']}/test"
        ok = client.post(test_url, json=event, headers=auth).json()
        assert (ok["success"], ok["status_code"], ok["error"]) == (True, 200, None)
        failed = client.post(test_url, json=event, headers=auth).json()
        assert (failed["success"], failed["status_code"], failed["error"]) == (False, 500, "HTTP 500")
        assert len(rx.hits) == 2
    unreachable = client.post(test_url, json=event, headers=auth)
    assert unreachable.status_code == 200, unreachable.text
    got = unreachable.json()
    assert (got["success"], got["status_code"]) == (False, 0)
    assert got["error"] == "could not get an answer (connection or protocol error)"


def test_a_urls_credentials_are_not_logged(client, auth, caplog):
    """The test delivery's HTTP client logs the URL it calls (httpx, at INFO): its userinfo is redacted there
    too, as it is in the endpoint's view."""
    # httpx's own logger at INFO too: importing the `tinker` SDK (the Tinker tests do) sets it to WARNING.
    with Receiver((200,)) as rx, caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="httpx"):
        url = rx.url.replace("http://", "http://hook-user:pw-logged-1@")
        ep = client.post("/v1/webhook_endpoints", json={"url": url, "event_types": ALL, "name": "t"}, headers=auth)
        assert ep.status_code == 200, ep.text
        assert ep.json()["url"] == rx.url.replace("http://", "http://[redacted]@")
        sent = client.post(f"/v1/webhook_endpoints/{ep.json()['id']}/test", json={"event_type": ALL[0]}, headers=auth)
        assert sent.json()["success"] is True and rx.hits[0][0]["authorization"].startswith("Basic ")
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("httpx")]
    assert any("[redacted]@127.0.0.1" in line for line in logged), logged
    assert "pw-logged-1" not in caplog.text and "hook-user" not in caplog.text

"""Bad input anywhere in a request is a 4xx naming the field (and line), never a 500 or a silent null:
deep nesting, NaN/Infinity, over-long integers, booleans for integers, a bad Last-Event-ID."""

from __future__ import annotations

from sqlalchemy import func, select

from store.models import Checkpoint, Job
from tests.api.conftest import job_body
from tests.api.test_files import count_files, stored_objects


def _raw_job(
    file_id: str, reward: str = '{"type": "string_check", "reference": "a", "operation": "eq"}', extra: str = ""
) -> bytes:
    return (
        f'{{"model": "toy", "training_file": "{file_id}", "reward": {reward}, '
        f'"hyperparameters": {{"steps": 2}}{extra}}}'
    ).encode()


BAD_JOB_BODIES = [  # (reward, more fields, the field named, in the message)
    ('{"type": "string_check", "reference": "a", "operation": "eq", "w": NaN}', "", "reward.w", "NaN"),
    (
        '{"type": "string_check", "reference": "a", "operation": "eq"}',
        ', "metadata": {"x": Infinity}',
        "metadata.x",
        "Infinity",
    ),
    (
        '{"type": "string_check", "reference": "a", "operation": "eq", "w": [1, 2, -Infinity]}',
        "",
        "reward.w[2]",
        "Infinity",
    ),
    ('{"type": "string_check", "reference": "a", "operation": "eq", "w": 1e999}', "", "reward.w", "finite"),
    (
        '{"type": "string_check", "reference": "a", "operation": "eq", "w": ' + "9" * 5000 + "}",
        "",
        "reward.w",
        "5000 digits",
    ),
    ('{"type": "multi", "graders": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}", "", "reward.graders.a.a", "nested"),
    ("1", ', "name": ' + "[" * 200_000 + "]" * 200_000, "body", "nested"),
    (
        '{"type": "string_check", "reference": "a", "operation": "eq"}',
        ', "metadata": {"a": "\\udc00x"}',
        "metadata.a",
        "surrogate",
    ),  # was a 500 after the job had been created (the answer could not be encoded)
]


def test_bad_json_in_a_job_is_a_422_naming_the_field(client, app, auth, uploaded, model_name):
    for reward, extra, field, fragment in BAD_JOB_BODIES:
        r = client.post(
            "/v1/jobs",
            content=_raw_job(uploaded["id"], reward, extra),
            headers={**auth, "Content-Type": "application/json"},
        )
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_json" and err["field"].startswith(field) and fragment in err["message"], err
    with app.state.db.session() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0


def test_bad_json_in_a_dry_run_is_a_422(client, auth):
    body = b'{"reward": {"type": "string_check", "reference": "a"}, "item": {"n": NaN}, "samples": ["a"]}'
    r = client.post("/v1/rewards/run", content=body, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "item.n", r.text


def test_seed_must_be_an_integer_and_last_event_id_one_we_sent(client, auth, uploaded, model_name):
    for seed in (True, "1", 1.5):
        r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "seed": seed}, headers=auth)
        assert r.status_code == 422 and r.json()["error"]["field"] == "seed", r.text
    job = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]
    for value in ("abc", "1", "1.2.3", "-1.0", "1." + "9" * 30, "9" * 19 + ".0", "1.0 x"):
        r = client.get(f"/v1/jobs/{job}/events", headers={**auth, "Last-Event-ID": value})
        assert r.status_code == 400 and r.json()["error"]["field"] == "Last-Event-ID", (value, r.text)


BAD_ROWS = [  # (file, line, field, in the message)
    (b'{"prompt": "a"}\n{"prompt": "b", "x": ' + b"[" * 50 + b"]" * 50 + b"}\n", 2, "x", "nested"),
    (b'{"prompt": "a"}\n' + b"[" * 60_000 + b"\n", 2, "file", "nested"),
    (b'{"prompt": "a", "score": NaN}\n', 1, "score", "NaN"),
    (b'{"prompt": "a"}\n\n{"prompt": "a", "m": {"v": [Infinity]}}\n', 3, "m.v[0]", "Infinity"),
    (b'{"prompt": "a", "big": 1e400}\n', 1, "big", "finite"),
    (b'{"prompt": "a", "n": ' + b"1" * 5000 + b"}\n", 1, "n", "5000 digits"),
    (b'{"prompt": "a", ' + b", ".join(b'"k%d": 1' % i for i in range(300)) + b"}\n", 1, "file", "fields"),
    (b'{"prompt": "a"}\n{"prompt": "' + b"a" * 70_000 + b'"}\n', 2, "file", "longer than"),
    (b'{"prompt": "\\ud800 lone"}\n', 1, "prompt", "surrogate"),
]


def test_bad_rows_are_a_400_naming_the_line(client, app, settings, auth):
    app.state.settings = settings.model_copy(update={"max_row_bytes": 65_536})
    for data, line, field, fragment in BAD_ROWS:
        r = client.post("/v1/files", files={"file": ("bad.jsonl", data)}, headers=auth)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["line"] == line and err["field"].startswith(field) and fragment in err["message"], err
    assert count_files(app) == 0 and stored_objects(settings) == []


def test_storage_quota_is_a_413_and_leaves_nothing(client, app, settings, auth, other_auth, toy_dataset):
    app.state.settings = settings.model_copy(update={"max_file_storage_bytes_per_tenant": 2 * len(toy_dataset) + 10})
    for _ in range(2):
        assert client.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=auth).status_code == 201
    r = client.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["type"] == "storage_quota_exceeded", r.text
    assert "delete files" in r.json()["error"]["message"] and r.json()["error"]["field"] == "file"
    assert count_files(app) == 2 and len(stored_objects(settings)) == 2
    # The quota is per tenant; deleting a file makes room again.
    assert client.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=other_auth).status_code == 201
    first = client.get("/v1/files", headers=auth).json()["data"][0]["id"]
    assert client.delete(f"/v1/files/{first}", headers=auth).status_code == 204
    assert client.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=auth).status_code == 201
    assert count_files(app) == 3 and len(stored_objects(settings)) == 3


def test_checkpoints_count_in_the_storage_quota(
    client, app, settings, auth, other_auth, toy_dataset, job_with_progress
):
    """A tenant's checkpoints fill its quota as its files do: an upload past it is a 413, a job submitted at
    it a 409 (it could keep no checkpoint); deleting the checkpoint's job makes room again."""
    with app.state.db.session() as s:
        ckpt_bytes = s.scalar(select(func.sum(Checkpoint.size_bytes)))
    assert ckpt_bytes > 5000
    # Room for a second file if checkpoints did not count, not with them.
    app.state.settings = settings.model_copy(
        update={"max_file_storage_bytes_per_tenant": 2 * len(toy_dataset) + ckpt_bytes // 2}
    )
    r = client.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["type"] == "storage_quota_exceeded", r.text
    assert "files and checkpoints" in r.json()["error"]["message"]
    assert client.post("/v1/files", files={"file": ("t.jsonl", toy_dataset)}, headers=other_auth).status_code == 201
    file_id = client.get("/v1/files", headers=auth).json()["data"][0]["id"]
    app.state.settings = settings.model_copy(
        update={"max_file_storage_bytes_per_tenant": len(toy_dataset) + ckpt_bytes}
    )
    r = client.post("/v1/jobs", json=job_body(file_id), headers=auth)
    assert r.status_code == 409 and r.json()["error"]["type"] == "storage_quota_exceeded", r.text
    assert client.delete(f"/v1/jobs/{job_with_progress}", headers=auth).status_code == 204
    assert client.post("/v1/jobs", json=job_body(file_id), headers=auth).status_code == 201

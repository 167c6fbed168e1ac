"""/v1/files: upload validation (each bad case names its line and leaves nothing behind)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from store.models import File


def count_files(app) -> int:
    with app.state.db.session() as s:
        return s.scalar(select(func.count()).select_from(File))


def stored_objects(settings) -> list:
    root = settings.data_dir / "objects"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_upload_list_get_content_delete(client, auth, toy_dataset, uploaded):
    assert uploaded["rows"] == 16 and uploaded["bytes"] == len(toy_dataset)
    assert set(uploaded["item_fields"]) == {"prompt", "answer", "target"}
    assert [f["id"] for f in client.get("/v1/files", headers=auth).json()["data"]] == [uploaded["id"]]
    assert client.get(f"/v1/files/{uploaded['id']}", headers=auth).json()["rows"] == 16
    content = client.get(f"/v1/files/{uploaded['id']}/content", headers=auth)
    assert content.status_code == 200 and content.content == toy_dataset
    assert client.delete(f"/v1/files/{uploaded['id']}", headers=auth).status_code == 204
    assert client.get(f"/v1/files/{uploaded['id']}", headers=auth).status_code == 404


def test_messages_rows_are_accepted(client, auth):
    data = b'{"messages": [{"role": "user", "content": "hi"}], "answer": "x"}\n\n'
    r = client.post("/v1/files", files={"file": ("chat.jsonl", data)}, headers=auth)
    assert r.status_code == 201 and r.json()["rows"] == 1


@pytest.mark.parametrize(
    "data,status,line,field",
    [
        (b'{"prompt": "a"}\n\xff\xfe\n', 400, 2, "file"),
        (b'{"prompt": "a"}\n{"prompt": \n', 400, 2, "file"),
        (b'{"prompt": "a"}\n[1, 2]\n', 400, 2, "file"),
        (b'{"prompt": "a"}\n{"question": "b"}\n', 400, 2, "prompt"),
        (b'{"prompt": ""}\n', 400, 1, "prompt"),
        (b'{"messages": [{"role": "user"}]}\n', 400, 1, "messages[0]"),
        (b"", 400, None, "file"),
        (b"\n\n", 400, None, "file"),
        (b'{"prompt": "a"}\n' * 501, 413, 501, "file"),
    ],
)
def test_bad_uploads_are_refused_and_leave_nothing(client, app, settings, auth, data, status, line, field):
    r = client.post("/v1/files", files={"file": ("bad.jsonl", data)}, headers=auth)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["line"] == line and err["field"] == field and err["message"]
    assert count_files(app) == 0 and stored_objects(settings) == []


def test_over_the_size_cap_is_413(client, app, settings, auth):
    big = b'{"prompt": "' + b"a" * 250_000 + b'"}\n'
    r = client.post("/v1/files", files={"file": ("big.jsonl", big)}, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["type"] in ("file_too_large", "request_too_large")
    assert count_files(app) == 0 and stored_objects(settings) == []


def test_a_file_in_use_cannot_be_deleted(client, auth, uploaded, model_name):
    from tests.api.conftest import job_body

    assert client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).status_code == 201
    r = client.delete(f"/v1/files/{uploaded['id']}", headers=auth)
    assert r.status_code == 409 and r.json()["error"]["type"] == "file_in_use"

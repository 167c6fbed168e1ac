"""The data directory and what the service writes in it are its own user's only (0700 / 0600), even
under a permissive umask: the SQLite database, the local object store, uploads, checkpoints, the broker."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest
from sqlalchemy import text

from store.db import Database, run_migrations
from store.objects import get_dir, get_object_store, put_dir
from store.queue import broker_options
from store.settings import Settings


@pytest.fixture()
def open_umask():
    old = os.umask(0)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_everything_under_the_data_dir_is_private(tmp_path, open_umask):
    data = tmp_path / "srv" / "data"
    settings = Settings(data_dir=data)
    run_migrations(settings.resolved_database_url())
    db = Database(settings.resolved_database_url())
    with db.session() as s:  # a write: SQLite creates its -wal and -shm files (removed when it closes)
        s.execute(text("CREATE TABLE IF NOT EXISTS t (x INTEGER)"))
        s.execute(text("INSERT INTO t VALUES (1)"))
    wal = {p.name: mode(p) for p in data.glob("gspo.db-*")}
    assert wal == {"gspo.db-wal": 0o600, "gspo.db-shm": 0o600}, wal
    store = get_object_store(settings)
    store.put_bytes("tenants/t1/files/f1.jsonl", b'{"prompt": "x"}\n')
    store.put_fileobj("tenants/t2/files/f2.jsonl", io.BytesIO(b'{"prompt": "y"}\n'))  # an upload's spooled file
    ckpt = tmp_path / "ckpt"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "model.safetensors").write_bytes(b"weights")
    assert mode(ckpt / "model" / "model.safetensors") == 0o666  # the umask really is open
    put_dir(store, "jobs/j1/checkpoints/step-000001-a1", ckpt)
    broker_options(settings)
    fetched = get_dir(store, "jobs/j1/checkpoints/step-000001-a1", data / "work" / "j1" / "resume")
    db.dispose()
    assert mode(tmp_path / "srv") == 0o700 and mode(data) == 0o700
    files = [p for p in data.rglob("*") if p.is_file()]
    dirs = [p for p in data.rglob("*") if p.is_dir()]
    names = {p.name for p in files}
    assert {"gspo.db", "f1.jsonl", "f2.jsonl", "model.safetensors"} <= names, names
    assert (fetched / "model" / "model.safetensors").read_bytes() == b"weights"
    assert {str(p): oct(mode(p)) for p in files if mode(p) != 0o600} == {}
    assert {str(p): oct(mode(p)) for p in dirs if mode(p) != 0o700} == {}


def test_an_existing_data_dir_is_narrowed(tmp_path, open_umask):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    (data / "gspo.db").touch(mode=0o644)
    os.chmod(data / "gspo.db", 0o644)
    settings = Settings(data_dir=data)
    run_migrations(settings.resolved_database_url())
    get_object_store(settings)
    assert mode(data) == 0o700 and mode(data / "gspo.db") == 0o600 and mode(data / "objects") == 0o700

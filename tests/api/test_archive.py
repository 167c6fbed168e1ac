"""The streamed checkpoint archive: complete when read to the end, and no thread left when abandoned."""

from __future__ import annotations

import io
import os
import tarfile
import threading
import time

from api.services import archive
from store.objects import LocalObjectStore


def _store(tmp_path):
    objects = LocalObjectStore(tmp_path / "objects")
    blobs = {f"ck/model/part-{i}.bin": os.urandom(64 * 1024) for i in range(3)}
    for key, data in blobs.items():
        objects.put_bytes(key, data)
    return objects, blobs


def test_archive_holds_every_member(tmp_path):
    objects, blobs = _store(tmp_path)
    members = archive.archive_members(objects, "ck")
    data = b"".join(archive.stream_tar_gz(objects, members, "root"))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert got == {f"root/{k[3:]}": v for k, v in blobs.items()}


def _producers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tar-stream"]


def test_abandoned_download_stops_its_producer(tmp_path, monkeypatch):
    # Small chunks, so the producer fills the bounded queue long before the archive is done, as a
    # multi-GB checkpoint does when the client disconnects after the first megabytes.
    monkeypatch.setattr(archive, "CHUNK", 1024)
    objects, _ = _store(tmp_path)
    before = set(_producers())
    stream = archive.stream_tar_gz(objects, archive.archive_members(objects, "ck"), "root")
    assert next(stream)
    time.sleep(0.3)  # the producer is now blocked on the full queue
    assert [t for t in _producers() if t not in before], "the producer should still be running"
    stream.close()  # what the server does when the client goes away
    deadline = time.monotonic() + 5
    while [t for t in _producers() if t not in before] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in _producers() if t not in before], "an abandoned download left its thread blocked"

"""Object storage for real: the local directory and S3 over HTTP (moto's standalone server)."""

from __future__ import annotations

import io

import httpx
import pytest

from store.objects import BadKey, LocalObjectStore, ObjectStore, S3ObjectStore, get_dir, put_dir


def test_roundtrip_dirs_streams_and_delete(objects, tmp_path):
    assert isinstance(objects, ObjectStore)  # the one interface the API and the worker are typed against
    src = tmp_path / "src"
    (src / "model").mkdir(parents=True)
    (src / "model" / "w.bin").write_bytes(b"\x00" * 3_000_000)
    (src / "state.pt").write_bytes(b"abc")
    assert put_dir(objects, "t/ckpt", src) == 3_000_003
    assert [k for k, _ in objects.list("t/ckpt")] == ["t/ckpt/model/w.bin", "t/ckpt/state.pt"]
    assert b"".join(objects.open_stream("t/ckpt/model/w.bin")) == b"\x00" * 3_000_000
    out = get_dir(objects, "t/ckpt", tmp_path / "out")
    assert (out / "model" / "w.bin").stat().st_size == 3_000_000 and (out / "state.pt").read_bytes() == b"abc"
    objects.delete_prefix("t/ckpt")
    assert objects.list("t/ckpt") == []


@pytest.mark.parametrize("key", ["../x", "/abs", "a/../../b", "a//b", ""])
def test_keys_cannot_escape(objects, key):
    with pytest.raises(BadKey):
        objects.put_bytes(key, b"x")


def test_s3_presigned_url_serves_the_object(s3_settings):
    st = S3ObjectStore(s3_settings)
    st.ensure_bucket()
    st.put_bytes("t/a.txt", b"hello")
    url = st.presigned_url("t/a.txt")
    assert httpx.get(url).content == b"hello"
    assert LocalObjectStore.presigned_url(None, "x") is None


def test_s3_presigned_urls_use_the_public_endpoint(s3_settings):
    public = s3_settings.model_copy(update={"s3_public_endpoint_url": "http://downloads.example:9000"})
    st = S3ObjectStore(public)
    assert st.presigned_url("t/a.txt").startswith("http://downloads.example:9000/gspo-test/t/a.txt?")
    assert (
        S3ObjectStore(s3_settings.model_copy(update={"s3_presign_downloads": False})).presigned_url("t/a.txt") is None
    )


class _FailingReader(io.RawIOBase):
    """A source that breaks after its first chunk, as a client's upload or a disk read can."""

    def __init__(self) -> None:
        self.sent = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self.sent:
            raise OSError("the source broke")
        self.sent = True
        buf[:4] = b"data"
        return 4


def test_a_local_write_that_fails_leaves_nothing(tmp_path):
    store = LocalObjectStore(tmp_path / "objects")
    with pytest.raises(OSError, match="the source broke"):
        store.put_fileobj("a/b.jsonl", io.BufferedReader(_FailingReader()))
    assert [p for p in (tmp_path / "objects").rglob("*") if p.is_file()] == []
    assert store.remove_stale_parts() == 0

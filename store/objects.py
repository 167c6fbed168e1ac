"""Object storage behind one small interface: a local directory (default) or S3 (MinIO, AWS)."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol, runtime_checkable

from store.private import open_private, private_dir
from store.settings import Settings

CHUNK = 1024 * 1024
ARCHIVE_NAME = "archive.tar.gz"  # a checkpoint's pre-built download (stored on S3 for presigned URLs)
#: A ``.part`` younger than this is kept even unlocked: its writer may be between creating and locking it.
PART_GRACE_S = 5.0


class BadKey(ValueError):
    """A key that could escape its storage prefix (``..``, absolute, empty parts)."""


def check_key(key: str) -> str:
    parts = PurePosixPath(key).parts
    if not key or key.startswith("/") or "\\" in key or "//" in key or any(p in ("..", ".", "") for p in parts):
        raise BadKey(f"invalid object key {key!r}")
    return key


@runtime_checkable
class ObjectStore(Protocol):
    """What the API and the worker need of object storage; every store (local, S3) implements it.
    Keys are ``/``-separated paths checked by :func:`check_key`; a prefix names a folder-like key."""

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def put_file(self, key: str, src: str | Path) -> None: ...

    def put_fileobj(self, key: str, f: BinaryIO) -> None:
        """Store what ``f`` holds from its current position, copied in chunks."""
        ...

    def get_bytes(self, key: str) -> bytes: ...

    def open_stream(self, key: str) -> Iterator[bytes]: ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix``, or the object ``prefix`` itself."""
        ...

    def presigned_url(self, key: str, expires: int = 3600) -> str | None:
        """A URL the user's client can download ``key`` from, or None where the store has none."""
        ...

    def list(self, prefix: str) -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix``, sorted by key."""
        ...

    def remove_stale_parts(self) -> int:
        """Delete what writes that died midway left behind (a crashed API's or worker's upload); returns how
        many went. Writes in progress, in any process, are left alone."""
        ...


class LocalObjectStore(ObjectStore):
    """Objects as files under ``root``; keys are validated so nothing escapes it. Directories are 0700
    and files 0600: other users of the host (a sandboxed grader's uid among them) read nothing."""

    def __init__(self, root: Path) -> None:
        self.root = private_dir(Path(root).resolve())

    def _path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if self.root not in path.parents:
            raise BadKey(f"object key {key!r} escapes the store")
        return path

    @contextmanager
    def _writing(self, key: str) -> Iterator[BinaryIO]:
        """The object's ``.part`` file, renamed into place once written. Its writer holds an exclusive
        ``flock`` on it until then; the kernel drops the lock when the writer dies, however it dies, so
        :meth:`remove_stale_parts` knows a dead write from a live one in any process."""
        path = self._path(key)
        private_dir(path.parent)
        tmp = path.with_name(path.name + ".part")
        with open_private(tmp) as out:
            fcntl.flock(out.fileno(), fcntl.LOCK_EX)
            try:
                yield out
                out.flush()
                tmp.replace(path)
            except BaseException:  # a failed read or a full disk: nothing of it stays
                tmp.unlink(missing_ok=True)
                raise

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._writing(key) as out:
            out.write(data)

    def put_file(self, key: str, src: str | Path) -> None:
        with open(src, "rb") as f, self._writing(key) as out:
            shutil.copyfileobj(f, out, CHUNK)

    def put_fileobj(self, key: str, f: BinaryIO) -> None:
        """Store what ``f`` holds from its current position, copied in chunks."""
        with self._writing(key) as out:
            shutil.copyfileobj(f, out, CHUNK)

    def remove_stale_parts(self) -> int:
        """Every ``.part`` whose writer is gone (its lock free) and that is older than :data:`PART_GRACE_S`."""
        removed, now = 0, time.time()
        for part in self.root.rglob("*.part"):
            try:
                fd = os.open(part, os.O_RDONLY)
            except FileNotFoundError:  # renamed into place meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_mtime < now - PART_GRACE_S:
                    part.unlink(missing_ok=True)
                    removed += 1
            except BlockingIOError:  # a live write
                pass
            finally:
                os.close(fd)
        return removed

    def get_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def open_stream(self, key: str) -> Iterator[bytes]:
        with open(self._path(key), "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def list(self, prefix: str) -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix`` (a folder-like key)."""
        base = self._path(prefix.rstrip("/"))
        if not base.is_dir():
            return []
        return sorted(
            (str(p.relative_to(self.root)), p.stat().st_size)
            for p in base.rglob("*")
            if p.is_file() and not p.name.endswith(".part")
        )

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix.rstrip("/"))
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    def presigned_url(self, key: str, expires: int = 3600) -> str | None:
        return None


class S3ObjectStore(ObjectStore):
    """Objects in an S3 bucket through boto3 (AWS, MinIO, or moto's server in tests)."""

    def __init__(self, settings: Settings) -> None:
        import boto3

        self.bucket = settings.s3_bucket

        def client(endpoint: str | None) -> Any:  # boto3's clients are generated at run time: untyped
            return boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name=settings.s3_region,
                aws_access_key_id=settings.s3_access_key_id,
                aws_secret_access_key=settings.s3_secret_access_key,
            )

        self.client = client(settings.s3_endpoint_url)
        # Presigned URLs are signed for the host the user's client will reach (e.g. localhost:9000,
        # while services talk to minio:9000 inside the compose network).
        public = settings.s3_public_endpoint_url
        self.public_client = client(public) if public and public != settings.s3_endpoint_url else self.client
        self.presign = settings.s3_presign_downloads

    def ensure_bucket(self) -> None:
        existing = {b["Name"] for b in self.client.list_buckets().get("Buckets", [])}
        if self.bucket not in existing:
            self.client.create_bucket(Bucket=self.bucket)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=check_key(key), Body=data)

    def put_file(self, key: str, src: str | Path) -> None:
        self.client.upload_file(str(src), self.bucket, check_key(key))

    def put_fileobj(self, key: str, f: BinaryIO) -> None:
        from boto3.s3.transfer import TransferConfig

        # Two 8 MiB parts in flight (boto3's default is ten): an upload's buffers stay small.
        self.client.upload_fileobj(f, self.bucket, check_key(key), Config=TransferConfig(max_concurrency=2))

    def get_bytes(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=check_key(key))["Body"].read()

    def open_stream(self, key: str) -> Iterator[bytes]:
        body = self.client.get_object(Bucket=self.bucket, Key=check_key(key))["Body"]
        yield from body.iter_chunks(CHUNK)

    def list(self, prefix: str) -> list[tuple[str, int]]:
        prefix = check_key(prefix.rstrip("/")) + "/"
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
        return sorted(out)

    def delete_prefix(self, prefix: str) -> None:
        keys = [k for k, _ in self.list(prefix)] or [check_key(prefix)]
        for k in range(0, len(keys), 1000):
            self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": key} for key in keys[k : k + 1000]]}
            )

    def remove_stale_parts(self) -> int:
        """Nothing: S3 stores an object whole or not at all. A dead multipart upload's parts are the bucket's
        lifecycle rule's (``AbortIncompleteMultipartUpload``, docs/operations.md)."""
        return 0

    def presigned_url(self, key: str, expires: int = 3600) -> str | None:
        if not self.presign:
            return None
        return self.public_client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": check_key(key)}, ExpiresIn=expires
        )


def get_object_store(settings: Settings) -> ObjectStore:
    """S3 when ``S3_BUCKET`` is set, else ``<data_dir>/objects``. Makes the data directory private (0700)."""
    private_dir(settings.data_dir)
    if settings.s3_bucket:
        return S3ObjectStore(settings)
    return LocalObjectStore(settings.data_dir / "objects")


def put_dir(store: ObjectStore, prefix: str, src: Path) -> int:
    """Upload every file under ``src`` to ``prefix/<relative path>``; returns total bytes."""
    total = 0
    for path in sorted(Path(src).rglob("*")):
        if path.is_file():
            store.put_file(f"{prefix}/{path.relative_to(src).as_posix()}", path)
            total += path.stat().st_size
    return total


def get_dir(store: ObjectStore, prefix: str, dest: Path) -> Path:
    """Download every object under ``prefix`` into ``dest`` (relative layout kept)."""
    dest = Path(dest)
    for key, _ in store.list(prefix):
        rel = key[len(prefix.rstrip("/")) + 1 :]
        target = (dest / check_key(rel)).resolve()
        private_dir(target.parent)
        with open_private(target) as f:
            for chunk in store.open_stream(key):
                f.write(chunk)
    return dest

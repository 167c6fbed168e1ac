"""Streams a checkpoint as one .tar.gz built on the fly from object storage (bounded memory)."""

from __future__ import annotations

import io
import queue
import tarfile
import threading
import time
from collections.abc import Iterator

from store.objects import ObjectStore

CHUNK = 1024 * 1024


class _Abandoned(Exception):
    """The client went away: the producer stops instead of waiting forever on a full queue."""


class _QueueWriter:
    """A write-only file object whose writes become chunks in a bounded queue. tarfile's stream mode
    (``w|gz``) only writes to it; ``read``, ``seek``, ``tell`` and ``close`` complete the file object
    tarfile.open accepts."""

    def __init__(self, q: queue.Queue[bytes | Exception | None], stop: threading.Event) -> None:
        self.q, self.stop, self.buf, self.written = q, stop, bytearray(), 0

    def put(self, item: bytes | Exception | None) -> None:
        while True:
            if self.stop.is_set():
                raise _Abandoned
            try:
                self.q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def write(self, data: bytes) -> int:
        self.written += len(data)
        self.buf += data
        if len(self.buf) >= CHUNK:
            self.put(bytes(self.buf))
            self.buf.clear()
        return len(data)

    def flush(self) -> None:
        if self.buf:
            self.put(bytes(self.buf))
            self.buf.clear()

    def tell(self) -> int:
        return self.written

    def read(self, size: int = -1, /) -> bytes:
        raise io.UnsupportedOperation("write-only")

    def seek(self, pos: int, /) -> int:
        raise io.UnsupportedOperation("not seekable")

    def close(self) -> None:
        self.flush()


class _StreamReader:
    """A read-only file object over an iterator of byte chunks (what tarfile.addfile reads)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.it, self.buf = iter(chunks), b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self.buf) < n:
            try:
                self.buf += next(self.it)
            except StopIteration:
                break
        if n < 0:
            out, self.buf = self.buf, b""
        else:
            out, self.buf = self.buf[:n], self.buf[n:]
        return out


def archive_members(objects: ObjectStore, prefix: str) -> list[tuple[str, str, int]]:
    """``(key, name in archive, size)`` of the downloadable parts: model/ and adapter/."""
    out = []
    for part in ("model", "adapter"):
        for key, size in objects.list(f"{prefix}/{part}"):
            out.append((key, key[len(prefix) + 1 :], size))
    return out


def stream_tar_gz(objects: ObjectStore, members: list[tuple[str, str, int]], root: str) -> Iterator[bytes]:
    """Yield a gzip'd tar of ``members`` under ``root/``; a producer thread fills a bounded queue."""
    q: queue.Queue[bytes | Exception | None] = queue.Queue(maxsize=8)
    stop = threading.Event()

    def produce() -> None:
        writer = _QueueWriter(q, stop)
        try:
            try:
                with tarfile.open(fileobj=writer, mode="w|gz") as tar:
                    for key, name, size in members:
                        info = tarfile.TarInfo(f"{root}/{name}")
                        info.size, info.mtime, info.mode = size, int(time.time()), 0o644
                        tar.addfile(info, _StreamReader(objects.open_stream(key)))
                writer.flush()
            except _Abandoned:
                raise
            except Exception as exc:  # surfaces as a broken download, never a silent truncation
                writer.put(exc)
            writer.put(None)  # the end
        except _Abandoned:
            pass

    threading.Thread(target=produce, name="tar-stream", daemon=True).start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:  # also on a client disconnect (the server closes this generator)
        stop.set()

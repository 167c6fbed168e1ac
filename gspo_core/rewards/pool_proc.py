"""One grader-pool process as its parent sees it: a JSON-lines stream over its stdin and stdout, and its kill."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import time
from typing import IO


class PoolProcess:
    """One pool process and its half-read protocol stream."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        if popen.stdin is None or popen.stdout is None:
            raise ValueError("a pool process talks over its stdin and stdout: start it with both piped")
        self.popen, self.stdin, self.stdout = popen, popen.stdin, popen.stdout
        self.buf = bytearray()
        self.defined: set[str] = set()

    def send(self, obj: dict | str) -> bool:
        line = obj if isinstance(obj, str) else json.dumps(obj)
        try:
            self.stdin.write(line.encode() + b"\n")
            self.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def read(self, deadline: float) -> dict | None:
        """The next protocol message, or None when the deadline passed or the process ended."""
        fd = self.stdout.fileno()
        end = self.buf.find(b"\n")
        while end < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            # Only the new chunk is searched: a long answer (a call's result) arrives in many chunks.
            end = chunk.find(b"\n")
            if end >= 0:
                end += len(self.buf)
            self.buf += chunk
        line = bytes(self.buf[:end])
        del self.buf[: end + 1]
        try:
            msg = json.loads(line)
        except ValueError:
            return None
        return msg if isinstance(msg, dict) else None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.popen.kill()
        self.popen.wait()
        streams: tuple[IO[bytes], ...] = (self.stdin, self.stdout)
        for stream in streams:
            with contextlib.suppress(OSError):
                stream.close()

"""Validating a large upload in a child process: its CPU time and memory stay off the API process (a
thread would take the GIL from the event loop for seconds). The child gets the spooled file's
descriptor; ``python -m api.services.scan FD MAX_ROWS MAX_ROW_BYTES`` prints ``{"rows", "fields"}`` or
``{"error": {"line", "field", "message"}}``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import BinaryIO

from gspo_core.data import DataError, jsonl_summary

NICE = 19
_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")


def scan_in_child(fh: BinaryIO, max_rows: int, max_row_bytes: int, timeout_s: float = 600.0) -> tuple[int, list[str]]:
    """``(rows, fields)`` of ``fh`` (a real file) validated in a child; raises :class:`DataError`."""
    fd = fh.fileno()
    env = {k: v for k, v in os.environ.items() if k in _ENV}
    done = subprocess.run(
        [sys.executable, "-m", "api.services.scan", str(fd), str(max_rows), str(max_row_bytes)],
        pass_fds=(fd,),
        env=env,
        capture_output=True,
        timeout=timeout_s,
        check=False,
    )
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        raise RuntimeError(
            f"the upload scan ended without an answer (exit code {done.returncode}): "
            f"{done.stderr[-500:].decode(errors='replace')}"
        ) from None
    if "error" in answer:
        e = answer["error"]
        raise DataError(e["line"], e["field"], e["message"])
    return answer["rows"], answer["fields"]


def main(argv: list[str]) -> int:
    os.nice(NICE)
    fd, max_rows, max_row_bytes = (int(a) for a in argv)
    with os.fdopen(fd, "rb", closefd=False) as f:
        f.seek(0)
        try:
            rows, fields = jsonl_summary(f, max_rows=max_rows, max_row_bytes=max_row_bytes)
            answer = {"rows": rows, "fields": fields}
        except DataError as exc:
            answer = {"error": {"line": exc.line, "field": exc.field, "message": exc.message}}
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

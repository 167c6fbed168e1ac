"""Real OpenEnv servers for the tests (tests/core/openenv_server.py, run by .venv-openenv's Python): started on a
free loopback port, waited for, stopped."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import spawn_logged

ROOT = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).with_name("openenv_server.py")
#: The test-only environment with PyPI `openenv` (scripts/openenv-env.sh; `make install` builds it).
OPENENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
#: Seconds a server may take to start: openenv imports fastapi, gradio and fastmcp (slow on a loaded machine).
START_S = 180
TOKEN = "sekrit-token"


def openenv_python() -> Path:
    """The openenv environment's interpreter; a missing one skips the test, or fails it in CI (where
    `make install` must have built it)."""
    if OPENENV_PYTHON.exists():
        return OPENENV_PYTHON
    why = f"{OPENENV_PYTHON} is missing: run `make install` (scripts/openenv-env.sh builds it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why)
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OpenEnvServer:
    """The guessing game's server (``args``: its options) on a free loopback port; ``url`` is its base URL."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = spawn_logged([str(openenv_python()), str(SERVER), str(self.port), *args], log, cwd=ROOT)
        deadline = time.monotonic() + START_S
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the OpenEnv server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

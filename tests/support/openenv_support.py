"""Real OpenEnv servers for the tests (tests/support/openenv_server.py, run by .venv-openenv's Python): started on
a free loopback port, waited for, stopped."""

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
#: The address of the live service's test server (tests/api/conftest.py allows it, and only it, in its egress).
OPENENV_HOST = "127.0.0.2"


def step_reward(message: str) -> float:
    """The game's reward of one step (openenv_server.py's, which this venv cannot import)."""
    return 1.0 if len(message) % 2 == 0 else 0.25


def openenv_python() -> Path:
    """The openenv environment's interpreter; a missing one skips the test, or fails it in CI (where
    `make install` must have built it)."""
    if OPENENV_PYTHON.exists():
        return OPENENV_PYTHON
    why = f"{OPENENV_PYTHON} is missing: run `make install` (scripts/openenv-env.sh builds it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why)
    pytest.skip(why)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class OpenEnvServer:
    """The guessing game's server (``args``: its options) on a free port of ``host`` (a loopback address: the live
    service's tests use 127.0.0.2, the one address its egress allow-list opens); ``url`` is its base URL."""

    def __init__(self, log: Path, *args: str, host: str = "127.0.0.1") -> None:
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log = log
        cmd = [str(openenv_python()), str(SERVER), str(self.port), "--host", host, *args]
        self.proc = spawn_logged(cmd, log, cwd=ROOT)
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

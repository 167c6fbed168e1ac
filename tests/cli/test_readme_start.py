"""The README's own start, in a fresh clone inside a private (0700) directory: `make install`, then
`.venv/bin/gspo up` exactly as written, then a `python` grader, which must run in the bubblewrap sandbox."""

from __future__ import annotations

import os
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import spawn_logged
from tests.worker.conftest import ROOT, wait_for

PYTHON_GRADER = {
    "type": "python",
    "name": "exact",
    "source": "import numpy\ndef grade(sample, item):\n    return float(sample['output_text'] == item['answer'])",
}


#: `make install`'s targets that the README's start never uses (`gspo up` and a `python` grader): the verifiers
#: environments' venv and the OpenEnv test venv (~5 minutes of pip each) and the imported real model (a download
#: and a GGUF import). Make's ``-o`` takes them as built; this suite's own checkout has them, and the tests of
#: verifiers, OpenEnv and the real model run on those.
_NOT_USED = (
    ".venv-envs/.installed",
    ".venv-openenv/.installed",
    ".cache/real-models/SmolLM2-135M-Instruct/config.json",
)


def _install(clone: Path) -> None:
    """`make install` in ``clone``. Its first step (the project into .venv with the cpu, dev and bench extras:
    torch and vLLM from the package cache, minutes) is replaced by the smallest honest equivalent: a venv of
    the clone's own, its dependencies those this suite runs with (a .pth line), the clone's code installed
    editable. The system packages and the grader environment are `make install` itself; the targets the start
    does not use are skipped (_NOT_USED)."""
    py = clone / ".venv" / "bin" / "python"
    # No pip or setuptools of its own: the suite's (through the .pth line) build the editable install.
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(clone / ".venv")], check=True)
    own_site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    Path(own_site, "gspo-test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", "."]
    subprocess.run(pip, cwd=clone, check=True)
    (clone / ".venv" / "bin" / ".installed").touch()  # the Makefile's mark of that step
    env = {k: v for k, v in os.environ.items() if not k.startswith("GSPO_")}
    skip = [arg for target in _NOT_USED for arg in ("-o", target)]
    subprocess.run(["make", "install", *skip], cwd=clone, env=env, check=True, stdout=subprocess.DEVNULL)


@pytest.mark.slow
def test_the_readme_start_in_a_fresh_private_clone_runs_python_graders_in_bubblewrap():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/system-deps.sh installs it)")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    home = Path(tempfile.mkdtemp(prefix="gspo-readme-"))  # 0700, as a private home directory is
    assert os.stat(home).st_mode & 0o777 == 0o700
    clone = home / "gspo"
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", head.strip()], check=True)
        _install(clone)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # The service's environment is the user's: none of our settings (no GSPO_GRADER_PYTHON), no PYTHONPATH.
        env = {k: v for k, v in os.environ.items() if not k.startswith("GSPO_") and k != "PYTHONPATH"}
        for name in ("DATABASE_URL", "REDIS_URL", "LOG_LEVEL"):
            env.pop(name, None)
        log = home / "up.log"
        proc = spawn_logged([".venv/bin/gspo", "up", "--port", str(port)], log, cwd=clone, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: proc.poll() is not None or _ready(url), 120, "gspo up ready")
            out = log.read_text()
            assert proc.poll() is None, out
            ready = httpx.get(url + "/readyz").json()
            assert ready["sandbox"] == "bubblewrap", (ready, out)
            assert "python graders: bubblewrap isolation" in out, out
            key = re.search(r"API key for tenant 'default': (\S+)", out).group(1)
            body = {"reward": PYTHON_GRADER, "item": {"answer": "4"}, "samples": ["4", "5"]}
            r = httpx.post(url + "/v1/rewards/run", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["reward"] for x in results] == [1.0, 0.0] and not any(x["errors"] for x in results), results
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        time.sleep(0.2)
        return False

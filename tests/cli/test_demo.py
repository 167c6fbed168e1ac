"""`gspo demo` (the README's first command): trains, downloads and loads its own checkpoint, also when run again."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.worker.conftest import ROOT


@pytest.mark.slow
def test_demo_twice_loads_each_runs_own_checkpoint(tmp_path):
    env = {**os.environ, "GSPO_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DATABASE_URL", None), env.pop("REDIS_URL", None)
    loaded = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-m", "gspo_cli.main", "demo", "--steps", "3", "--engine", "transformers"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        m = re.search(r"downloaded \S*/(ckpt_\w+)\.tar\.gz .* loaded with transformers from (\S+)", out.stdout)
        assert m and f"/{m.group(1)}/" in m.group(2), out.stdout[-2000:]
        assert "the trained model answers 'say c:' with" in out.stdout
        loaded.append(m.group(1))
    assert loaded[0] != loaded[1]  # the second run loads its own checkpoint, not the first run's

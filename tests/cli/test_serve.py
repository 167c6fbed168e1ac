"""`gspo serve` refuses a bind beyond loopback without a key, before it fetches anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gspo_cli.serve_cmd import is_loopback, serve_key_check
from tests.worker.conftest import ROOT


def test_serve_refuses_a_non_loopback_bind_without_a_key(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GSPO_DATA_DIR": str(tmp_path / "data")}
    env.pop("GSPO_SERVE_KEY", None)
    cmd = [sys.executable, "-m", "gspo_cli.main", "serve", "ckpt_abc", "--host", "0.0.0.0"]
    cmd += ["--cache-dir", str(tmp_path / "cache")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "refusing to serve on 0.0.0.0 without a key" in out.stderr, out
    assert not (tmp_path / "cache").exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_binds_serve_without_a_key_but_say_who_can_use_them(host):
    assert is_loopback(host)
    assert "every user and process on this machine" in serve_key_check(host, None)


def test_a_key_allows_any_bind_and_says_what_it_does_not_guard():
    assert not is_loopback("10.0.0.1") and not is_loopback("myhost")
    with pytest.raises(SystemExit):
        serve_key_check("myhost", None)
    assert "/metrics" in serve_key_check("0.0.0.0", "k")

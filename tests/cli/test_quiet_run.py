"""A quiet first run: `gspo demo` shows the service's own progress; libraries' logs show at --verbose only."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.worker.conftest import ROOT

# vLLM where it is installed: its engine is the noisy one (a log line per push, warnings at start).
ENGINE = "vllm" if importlib.util.find_spec("vllm") else "transformers"
# A record at that level in any of the formats seen here: Celery's "[...: ERROR/MainProcess]", vLLM's
# "ERROR 11-25 ...", logging's "... ERROR name: ...", uvicorn's "ERROR:".
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b")
INFO_LINE = re.compile(r"\bINFO\b")
# Set by the code under test itself; an outer setting would hide what it does.
OWN_VARIABLES = ("GSPO_LOG_LEVEL", "LOG_LEVEL", "VLLM_CONFIGURE_LOGGING", "HF_HUB_DISABLE_PROGRESS_BARS")


def run_demo(tmp_path, *args: str) -> list[str]:
    """`gspo demo` as a user runs it: its stdout and stderr together, one entry per line or bar update."""
    env = {**os.environ, "GSPO_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("DATABASE_URL", "REDIS_URL", "TORCH_CPP_LOG_LEVEL", *OWN_VARIABLES):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-m", "gspo_cli.main", "demo", "--engine", ENGINE, *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-5000:]
    return re.split(r"[\r\n]+", out.stdout)


@pytest.mark.slow
def test_the_demo_twice_quiet_then_verbose_each_loading_its_own_checkpoint(tmp_path):
    """The README's first command, then again in the same data directory with --verbose: the first run shows
    its own progress and no library noise; the second shows the libraries' INFO logs (so the quiet check
    could fail if they were not filtered); each loads the checkpoint it trained, not the other's."""
    loaded = []
    for steps, verbose in (("2", False), ("1", True)):
        lines = run_demo(tmp_path, "--steps", steps, *(["--verbose"] if verbose else []))
        text = "\n".join(lines)
        assert "[status] succeeded" in text and "the trained model answers 'say c:' with" in text, text[-3000:]
        found = re.search(r"downloaded \S*/(ckpt_\w+)\.tar\.gz .* loaded with transformers from (\S+)", text)
        assert found and f"/{found.group(1)}/" in found.group(2), text[-2000:]
        loaded.append(found.group(1))
        assert not [line for line in lines if ERROR_LINE.search(line)], text  # the worker's stop included
        assert "Traceback (most recent call last)" not in text, text
        assert "nanobind: leaked" not in text, text
        if verbose:
            _check_verbose(lines)
            continue
        assert not [line for line in lines if INFO_LINE.search(line)], text  # vLLM's at every push among them
        assert "Failed to load weights" not in text, text  # vLLM's false alarm at a push of a rotary model
        assert "Loading weights:" not in text and "Writing model shards" not in text, text  # progress bars
        assert "worker: Warm shutdown (MainProcess)" not in text, text  # Celery prints it to stdout
    assert loaded[0] != loaded[1]  # the second run loads its own checkpoint, not the first run's


def _check_verbose(lines: list[str]) -> None:
    info = [line for line in lines if INFO_LINE.search(line)]
    assert any("Task worker.tasks.run_job[" in line for line in info), lines  # Celery's
    assert any("Application startup complete" in line for line in info), lines  # uvicorn's
    if ENGINE == "vllm":
        assert any("Resolved architecture" in line for line in info), lines  # vLLM's, at the engine's start
        # vLLM's known false alarms are demoted to INFO, not dropped.
        assert all(INFO_LINE.search(line) for line in lines if "Failed to load weights" in line), lines

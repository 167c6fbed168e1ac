"""The worker's main process imports the job runner before its pool forks the job processes, and not torch."""

from __future__ import annotations

import subprocess
import sys

from tests.embedded_service import ROOT


def test_the_task_module_brings_the_runner_but_not_torch():
    """Celery's main process imports `worker.tasks` at start-up: the runner's modules come with it, so a job
    process forked from it does not import them inside the job's queue wait; torch, vLLM and transformers
    (gigabytes, and threads a fork must not copy) load only in the job process once it claims a job."""
    probe = "import sys, worker.tasks; print(sorted(m for m in ('worker.runner', 'store.jobs', 'torch', 'vllm', "
    probe += "'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "['store.jobs', 'worker.runner']", out.stdout + out.stderr

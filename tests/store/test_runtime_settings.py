"""The operator's runtime settings (rollout engine, vLLM memory share, heap policy) as gspo_core reads them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gspo_core.platform import RuntimeOptions
from store.settings import Settings


def test_settings_map_to_runtime_options(monkeypatch):
    monkeypatch.setenv("GSPO_ENVS_PYTHON", "")  # none found beside the venv, whatever this checkout has
    assert RuntimeOptions.from_mapping(Settings().runtime_options()) == RuntimeOptions()
    monkeypatch.setenv("GSPO_ROLLOUT_ENGINE", "transformers")
    monkeypatch.setenv("GSPO_VLLM_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("GSPO_KEEP_FREED_MEMORY", "false")
    monkeypatch.setenv("GSPO_AGENT_ENDPOINT_HOST", "0.0.0.0")
    monkeypatch.setenv("GSPO_AGENT_ENDPOINT_PORT", "8765")
    monkeypatch.setenv("GSPO_AGENT_ENDPOINT_URL", "https://worker-1.example.com/agents")
    monkeypatch.setenv("GSPO_RANK_TIMEOUT_S", "120")
    monkeypatch.setenv("GSPO_ENVS_PYTHON", "/opt/envs/bin/python")
    monkeypatch.setenv("GSPO_VERIFIERS_ENVIRONMENTS", " vf_toy, gsm8k ,")
    monkeypatch.setenv("GSPO_ENVS_PATH", "/srv/envs:/srv/more")
    assert RuntimeOptions.from_mapping(Settings().runtime_options()) == RuntimeOptions(
        rollout_engine="transformers",
        vllm_gpu_memory_utilization=0.5,
        keep_freed_memory=False,
        agent_endpoint_host="0.0.0.0",
        agent_endpoint_port=8765,
        agent_endpoint_url="https://worker-1.example.com/agents",
        rank_timeout_s=120,
        envs_python="/opt/envs/bin/python",
        verifiers_environments=("vf_toy", "gsm8k"),
        envs_path=("/srv/envs", "/srv/more"),
    )


def test_a_bad_runtime_setting_fails_at_start(monkeypatch):
    monkeypatch.setenv("GSPO_ROLLOUT_ENGINE", "tgi")
    with pytest.raises(ValidationError, match="ROLLOUT_ENGINE"):
        Settings()
    monkeypatch.delenv("GSPO_ROLLOUT_ENGINE")
    monkeypatch.setenv("GSPO_AGENT_ENDPOINT_URL", "worker-1:8765")  # not a URL
    with pytest.raises(ValidationError, match="AGENT_ENDPOINT_URL"):
        Settings()
    monkeypatch.delenv("GSPO_AGENT_ENDPOINT_URL")
    monkeypatch.setenv("GSPO_RANK_TIMEOUT_S", "0")
    with pytest.raises(ValidationError, match="RANK_TIMEOUT_S"):
        Settings()


def test_the_grader_environment_is_found_beside_the_services_venv():
    """With GSPO_GRADER_PYTHON unset (a `.venv/bin/gspo up` as the README says) the service uses the
    `.venv-graders` that `make install` built beside its venv; the variable still wins."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = "from store.settings import Settings; print(Settings().grader_python)"
    env = {k: v for k, v in os.environ.items() if k not in ("GSPO_GRADER_PYTHON", "GRADER_PYTHON")}
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    beside = Path(sys.prefix).parent / ".venv-graders" / "bin" / "python"
    assert found.stdout.strip() == (str(beside) if beside.exists() else "None"), found
    env["GSPO_GRADER_PYTHON"] = "/opt/graders/bin/python"
    named = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert named.stdout.strip() == "/opt/graders/bin/python"

"""The operator's runtime settings (rollout engine, vLLM memory share, heap policy) as gspo_core reads them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gspo_core.platform import RuntimeOptions
from store.settings import Settings


def test_settings_map_to_runtime_options(monkeypatch):
    assert RuntimeOptions.from_mapping(Settings().runtime_options()) == RuntimeOptions()
    monkeypatch.setenv("GSPO_ROLLOUT_ENGINE", "transformers")
    monkeypatch.setenv("GSPO_VLLM_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("GSPO_KEEP_FREED_MEMORY", "false")
    monkeypatch.setenv("GSPO_AGENT_ENDPOINT_HOST", "0.0.0.0")
    monkeypatch.setenv("GSPO_AGENT_ENDPOINT_PORT", "8765")
    monkeypatch.setenv("GSPO_AGENT_ENDPOINT_URL", "https://worker-1.example.com/agents")
    monkeypatch.setenv("GSPO_RANK_TIMEOUT_S", "120")
    assert RuntimeOptions.from_mapping(Settings().runtime_options()) == RuntimeOptions(
        rollout_engine="transformers",
        vllm_gpu_memory_utilization=0.5,
        keep_freed_memory=False,
        agent_endpoint_host="0.0.0.0",
        agent_endpoint_port=8765,
        agent_endpoint_url="https://worker-1.example.com/agents",
        rank_timeout_s=120,
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

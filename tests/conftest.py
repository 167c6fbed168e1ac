"""Test-wide set-up: offline, loopback-only vLLM settings and a shared tiny local model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

POSTGRES_URL = os.environ.get("GSPO_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("GSPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A deterministic toy Llama model + char tokenizer (head_dim 32, ~90 k parameters)."""
    from gspo_core.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "toy", shape="toy", seed=0)


def has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True

"""The environments venv and the small verifiers environment the tests name (tests/support/vf_envs/vf_toy)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The test environment's directory: the runner imports it from there (GSPO_ENVS_PATH), nothing is installed.
VF_TOY_DIR = ROOT / "tests" / "support" / "vf_envs" / "vf_toy"
#: Where `make install` builds the environments venv (scripts/envs-env.sh).
ENVS_PYTHON = ROOT / ".venv-envs" / "bin" / "python"


def envs_python() -> Path:
    """The environments venv's interpreter; a test that needs it is skipped without it, except in CI (where
    `make install` builds it, so its absence is a failure)."""
    if not ENVS_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{ENVS_PYTHON} is missing: `make install` builds it (scripts/envs-env.sh)")
        pytest.skip(f"{ENVS_PYTHON} is missing: run `make install`")
    return ENVS_PYTHON


def envs_settings() -> dict[str, str]:
    """The operator's settings (env vars) that allow the test environment and find it."""
    return {
        "GSPO_VERIFIERS_ENVIRONMENTS": "vf_toy",
        "GSPO_ENVS_PYTHON": str(ENVS_PYTHON),
        "GSPO_ENVS_PATH": str(VF_TOY_DIR),
    }

"""docker-compose.yml stays in step with Settings: every service variable is one Settings reads."""

from __future__ import annotations

from pathlib import Path

import yaml

from store.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
FOREIGN = {"HF_HOME"}  # read by the Hugging Face libraries, not by Settings


def _settings_env_names() -> set[str]:
    names = set()
    for field in Settings.model_fields.values():
        names |= set(field.validation_alias.choices)
    return names


def test_compose_service_env_is_known_to_settings():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    known = _settings_env_names()
    for name in ("api", "worker", "worker-multi-gpu", "migrate"):
        env = compose["services"][name]["environment"]
        unknown = set(env) - known - FOREIGN
        assert not unknown, f"{name}: {unknown} are not Settings variables"
        settings = Settings(**{k: v for k, v in env.items() if k in known})
        assert (
            settings.redis_url
            and settings.s3_bucket
            and settings.resolved_database_url().startswith("postgresql+psycopg")
        )
    for name, gpus in (("worker", 1), ("worker-multi-gpu", 4)):
        worker = compose["services"][name]
        (reserved,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert reserved["capabilities"] == ["gpu"] and reserved["count"] == gpus
        # the worker advertises the devices it reserves, so it takes only the jobs that fit them
        assert Settings(**{k: v for k, v in worker["environment"].items() if k in known}).worker_devices == gpus
        assert worker["command"][:2] == ["gspo", "worker"] and "seccomp=unconfined" in worker["security_opt"]
    assert compose["services"]["worker-multi-gpu"]["profiles"] == ["multi-gpu"]
    for name in ("api", "worker", "worker-multi-gpu"):
        assert compose["services"][name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"

"""The embedded service of the dashboard and client-CLI tests, started once per session (3 jobs trained)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# Session-scoped: tests/cli/test_client_cli.py and tests/e2e/test_dashboard.py read the same three trained
# jobs, so they share one start-up and one training of them (each module used to build its own).
@pytest.fixture(scope="session")
def embedded_service(tmp_path_factory):
    """Embedded default: SQLite, local objects, filesystem broker, a real worker subprocess, uvicorn."""
    from api.app import create_app
    from gspo_client import Client
    from gspo_core.toy import build_tiny_model
    from store.db import run_migrations
    from store.settings import Settings
    from store.tenants import create_tenant_and_key
    from tests.api.live import LiveServer
    from tests.conftest import spawn_logged

    tmp = tmp_path_factory.mktemp("dash")
    env_vals = {
        "GSPO_DATA_DIR": str(tmp),
        "GSPO_MODELS_DIR": str(tmp / "models"),
        "GSPO_ROLLOUT_ENGINE": "transformers",
    }
    settings = Settings(data_dir=tmp, models_dir=tmp / "models")
    run_migrations(settings.resolved_database_url())
    build_tiny_model(settings.models_dir / "toy")
    env = {**os.environ, **env_vals, "PYTHONPATH": str(ROOT)}
    worker = spawn_logged(
        [sys.executable, "-m", "gspo_cli.main", "worker", "--loglevel", "WARNING"],
        tmp / "worker.log",
        env=env,
        cwd=ROOT,
    )
    app = create_app(settings)
    with app.state.db.session() as s:
        _, key = create_tenant_and_key(s, "dash")
    with LiveServer(app) as live:
        with Client(live.url, key) as c:
            jobs = _train_jobs(c, tmp)
        yield live.url, key, *jobs
    worker.terminate()
    worker.wait(30)


def _train_jobs(c, tmp: Path) -> tuple[str, str, str]:
    """Three jobs, run to their end: a reinforcement job with checkpoints, a short second one (for the compare
    page), and a supervised one."""
    from gspo_core.toy import TOY_REWARD, write_toy_dataset
    from tests.api.test_openai_sdk import chat_rows

    f = c.upload_file(write_toy_dataset(tmp / "toy.jsonl", n=32))
    job = c.create_job(
        model="toy",
        training_file=f["id"],
        reward=TOY_REWARD,
        name="dashboard-demo",
        hyperparameters={
            "steps": 12,
            "prompts_per_step": 4,
            "group_size": 8,
            "max_new_tokens": 4,
            "learning_rate": 3e-3,
            "save_every": 6,
        },
    )
    second = c.create_job(
        model="toy",
        training_file=f["id"],
        reward=TOY_REWARD,
        name="second",
        hyperparameters={"steps": 4, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4},
    )
    chat = tmp / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in chat_rows("abcdabcd")))
    sft = c.create_job(
        model="toy",
        training_file=c.upload_file(chat)["id"],
        name="supervised",
        hyperparameters={"method": "supervised", "steps": 4, "prompts_per_step": 4, "learning_rate": 3e-3},
    )
    for j in (job, second, sft):
        for _ in c.events(j["id"]):
            pass
    for j in (job, sft):
        assert c.get_job(j["id"])["status"] == "succeeded", (tmp / "worker.log").read_text()[-3000:]
    return job["id"], second["id"], sft["id"]

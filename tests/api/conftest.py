"""API test fixtures: the real app on SQLite and on a fresh PostgreSQL database, two tenants."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from gspo_core.toy import write_toy_dataset
from store import jobs, progress
from store.db import run_migrations
from store.models import Job
from store.objects import put_dir
from store.settings import Settings
from store.tenants import create_tenant_and_key
from tests.conftest import empty_database_url
from tests.support.openenv_support import OPENENV_HOST
from tests.support.verifiers_support import envs_settings
from tests.worker.conftest import ROOT, wait_for


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path):
    return Settings(
        data_dir=tmp_path,
        database_url=empty_database_url(request, tmp_path),
        models_dir=tmp_path / "models",
        max_upload_bytes=200_000,
        max_file_rows=500,
        max_active_jobs_per_tenant=3,
    )


@pytest.fixture()
def app(settings):
    from api.app import create_app

    app = create_app(settings)
    yield app
    app.state.db.dispose()


@pytest.fixture()
def client(app):
    with TestClient(app) as c:
        yield c


def _key(app, name: str) -> str:
    with app.state.db.session() as s:
        _, key = create_tenant_and_key(s, f"{name}-{uuid.uuid4().hex[:6]}")
    return key


@pytest.fixture()
def auth(app) -> dict:
    return {"Authorization": f"Bearer {_key(app, 'acme')}"}


@pytest.fixture()
def other_auth(app) -> dict:
    return {"Authorization": f"Bearer {_key(app, 'globex')}"}


@pytest.fixture(scope="session")
def toy_dataset(tmp_path_factory):
    return write_toy_dataset(tmp_path_factory.mktemp("data") / "toy.jsonl", n=16).read_bytes()


@pytest.fixture()
def model_name(settings, tiny_model_dir) -> str:
    """The session's toy model, copied under this test's models directory (a copy costs far less than a build)."""
    shutil.copytree(tiny_model_dir, settings.models_dir / "toy")
    return "toy"


@pytest.fixture()
def uploaded(client, auth, toy_dataset) -> dict:
    r = client.post("/v1/files", files={"file": ("toy.jsonl", toy_dataset)}, headers=auth)
    assert r.status_code == 201, r.text
    return r.json()


def job_body(file_id: str, model: str = "toy", **hp) -> dict:
    from gspo_core.toy import TOY_REWARD

    return {
        "model": model,
        "training_file": file_id,
        "reward": TOY_REWARD,
        "hyperparameters": {"steps": 2, "group_size": 4, "prompts_per_step": 2, **hp},
    }


@pytest.fixture()
def job_with_progress(client, app, settings, auth, uploaded, model_name, tmp_path):
    """A job that 'ran' 3 steps: rows written through store/ exactly as the worker writes them."""
    job_id = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=auth).json()["id"]
    ckpt_dir = tmp_path / "ckpt"
    (ckpt_dir / "model").mkdir(parents=True)
    (ckpt_dir / "model" / "config.json").write_text('{"a": 1}')
    (ckpt_dir / "model" / "model.safetensors").write_bytes(b"x" * 5000)
    (ckpt_dir / "trainer_state.pt").write_bytes(b"state")
    with app.state.db.session() as s:
        job = jobs.claim(s, job_id, "w1", 30)
        for step in (1, 2, 3):
            progress.record_step(s, job_id, step, {"reward/mean": step / 10, "loss": -step})
            progress.record_samples(
                s,
                job_id,
                step,
                [
                    {
                        "prompt": "say a:",
                        "item": {"answer": "a"},
                        "completions": [
                            {
                                "text": "aa",
                                "reward": 0.5,
                                "scores": {"m": 0.5},
                                "errors": {},
                                "tokens": 2,
                                "finish_reason": "stop",
                            }
                        ],
                    }
                ],
            )
        prefix = f"jobs/{job_id}/checkpoints/step-000003"
        size = put_dir(app.state.objects, prefix, ckpt_dir)
        progress.record_checkpoint(s, job, 3, prefix, size, True)
        jobs.transition(s, s.get(Job, job_id), "succeeded")
    return job_id


def embedded_env(tmp: Path, tiny_model_dir: Path) -> dict[str, str]:
    """The embedded default's settings of a test's `gspo api` + `gspo worker`: ``tmp`` as the data dir, the toy
    model's models dir, transformers rollouts."""
    return {
        "GSPO_DATA_DIR": str(tmp),
        "GSPO_MODELS_DIR": str(tiny_model_dir.parent),
        "GSPO_ROLLOUT_ENGINE": "transformers",
    }


def sessions_env(tmp: Path, tiny_model_dir: Path) -> dict[str, str]:
    """:func:`embedded_env` with a worker serving Tinker sessions, which logs its sampling engines' starts and
    its sample batches (INFO); the SDK's telemetry off."""
    return {
        **embedded_env(tmp, tiny_model_dir),
        "GSPO_WORKER_MODE": "sessions",
        "TINKER_TELEMETRY": "0",
        "GSPO_LOG_LEVEL": "INFO",
    }


# Package-scoped: test_openai_pause.py and test_openai_sdk.py share one pair of processes (each module
# used to start its own); every test there makes its own files and jobs.
@pytest.fixture(scope="package")
def service(tmp_path_factory, tiny_model_dir):
    """Embedded default (SQLite, local objects, filesystem broker): `gspo api` and `gspo worker` processes of
    the `openai` SDK tests: ``(url, keys of 4 tenants, data dir)``; the environment tests keep to the 4th, so
    the `openai` SDK tests' job lists hold only their own jobs."""
    tmp = tmp_path_factory.mktemp("openai")
    env_vals = {
        **embedded_env(tmp, tiny_model_dir),
        "GSPO_MAX_ACTIVE_JOBS_PER_TENANT": "3",
        **envs_settings(),  # the test verifiers environment, allowed (tests/api/test_environments.py)
        # Short limits on environments' generators (tests/api/test_environments.py), long enough for theirs; the
        # API's grader processes at normal priority, as that file's in-process API has them (the reason is there).
        "GSPO_ENVIRONMENT_CHECK_TIMEOUT_S": "3",
        "GSPO_ENVIRONMENT_GENERATE_TIMEOUT_S": "8",
        "GSPO_DRY_RUN_NICENESS": "0",
        # The test OpenEnv server's address (tests/api/test_environments.py): loopback, but not 127.0.0.1, which
        # stays refused, as every other loopback and private address does.
        "GSPO_EGRESS_ALLOW": OPENENV_HOST,
    }
    tenants = ("acme", "globex", "initech", "umbrella")
    with api_and_worker(tmp, env_vals, tiny_model_dir, tenants, ("--loglevel", "WARNING")) as (url, keys):
        yield url, keys, tmp


#: Device hours per period of each tenant of `tinker_service` (test_tinker_sdk.py's 4th tenant spends them).
TINKER_BUDGET_H = 100


# Package-scoped: the Tinker SDK tests and the tinker-cookbook loops share one `gspo api` + session worker (each
# module used to start its own); each keeps to its own tenants.
@pytest.fixture(scope="package")
def tinker_service(tmp_path_factory, tiny_model_dir):
    """``(url, keys of 5 tenants, data dir)``: `gspo api` + a session worker sharing a SQLite database and data
    dir; test_tinker_sdk.py uses the first 4 (the 4th spends its budget), test_tinker_cookbook.py the 5th."""
    tmp = tmp_path_factory.mktemp("tinker")
    env_vals = {
        **sessions_env(tmp, tiny_model_dir),
        "GSPO_MAX_ACTIVE_SESSIONS_PER_TENANT": "3",
        "GSPO_TENANT_DEVICE_HOURS_PER_PERIOD": str(TINKER_BUDGET_H),
    }
    tenants = ("acme", "globex", "initech", "umbrella", "cookbook")
    with api_and_worker(tmp, env_vals, tiny_model_dir, tenants) as (url, keys):
        yield url, keys, tmp


@contextmanager
def api_and_worker(
    tmp: Path, env_vals: dict[str, str], tiny_model_dir: Path, tenants: tuple[str, ...], worker_args: tuple = ()
) -> Iterator[tuple[str, list[str]]]:
    """`gspo api` on a free port and a `gspo worker` sharing ``tmp``'s SQLite database and data dir, run with
    ``env_vals``: ``(url, a key of each tenant)``, both processes stopped on leaving (also when the API did not
    come up)."""
    settings = Settings(data_dir=tmp, models_dir=tiny_model_dir.parent)
    run_migrations(settings.resolved_database_url())
    from store.db import Database

    db = Database(settings.resolved_database_url())
    with db.session() as s:
        keys = [create_tenant_and_key(s, f"{name}-{uuid.uuid4().hex[:6]}")[1] for name in tenants]
    db.dispose()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    commands = {"api": ["api", "--host", "127.0.0.1", "--port", str(port)], "worker": ["worker", *worker_args]}
    with ExitStack() as stack:
        for name, args in commands.items():
            stack.enter_context(gspo_process(tmp, env_vals, name, args))
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _up(url), 180, "API up")  # a minute or more on a loaded 2-core machine
        yield url, keys


@contextmanager
def gspo_process(tmp: Path, env_vals: dict[str, str], name: str, args: list[str]) -> Iterator[subprocess.Popen]:
    """A `gspo <args>` process run with ``env_vals``, its output in ``tmp/<name>.log``; terminated and waited for
    on leaving (a process a test killed is only waited for)."""
    env = {**os.environ, **env_vals, "PYTHONPATH": str(ROOT)}
    with open(tmp / f"{name}.log", "w") as log:
        cli = [sys.executable, "-m", "gspo_cli.main", *args]
        with subprocess.Popen(cli, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) as proc:
            try:
                yield proc
            finally:  # leaving the Popen waits for it
                proc.terminate()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False

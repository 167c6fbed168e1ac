"""Checks the one direction of imports between the project's packages (read from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"gspo_core", "api", "worker", "store", "gspo_client", "gspo_cli", "migrations"}
WEB_QUEUE_DB = {
    "fastapi",
    "starlette",
    "uvicorn",
    "celery",
    "kombu",
    "redis",
    "sqlalchemy",
    "alembic",
    "psycopg",
    "psycopg2",
    "boto3",
    "botocore",
}

# package -> packages of ours it may import (besides itself)
ALLOWED = {
    "gspo_core": set(),
    "store": set(),
    "api": {"store", "gspo_core"},
    "worker": {"store", "gspo_core"},
    "gspo_client": set(),
}
# api may use only these parts of gspo_core (config, reward specs, data validation, the egress policy that
# checks webhooks' URLs at registration, the delivery of a webhook test).
API_CORE_PREFIXES = (
    "gspo_core.config",
    "gspo_core.rewards",
    "gspo_core.data",
    "gspo_core.environments",  # checks a job's environment; its library (reasoning-gym) is imported lazily
    "gspo_core.egress",
    "gspo_core.delivery",  # a webhook endpoint's test delivery, sent as the worker sends them
    "gspo_core.agents.tools",  # validates a job's tools (no torch: see gspo_core/agents/__init__.py)
    "gspo_core.urls",  # a URL's credentials redacted where the API shows it (webhooks)
)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction(package):
    bad = []
    for path in _files(package):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in OURS and top != package and top not in ALLOWED[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if package == "api" and top == "gspo_core" and not name.startswith(API_CORE_PREFIXES):
                bad.append(f"{path.relative_to(ROOT)} imports {name} (see API_CORE_PREFIXES)")
    assert not bad, "\n".join(bad)


def test_gspo_core_has_no_web_queue_or_database_imports():
    bad = [
        f"{p.relative_to(ROOT)} imports {n}"
        for p in _files("gspo_core")
        for n in _imports(p)
        if n.split(".")[0] in WEB_QUEUE_DB
    ]
    assert not bad, "\n".join(bad)


def test_every_module_has_a_docstring():
    missing = []
    for package in sorted(OURS):
        for path in _files(package):
            if path.stat().st_size and ast.get_docstring(ast.parse(path.read_text())) is None:
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, "modules without a one-line docstring: " + ", ".join(missing)


#: The job loop and its steps, the checkpoints and the training primitives: every rank runs them as they read;
#: what rank 0 alone holds (engine, graders, callbacks, the writer of its files) is decided where the job or
#: session is built (`Ranks.lead`, `gspo_core.distributed.lead_writer`), and its results reach the others by
#: broadcast. The one test of the rank is `Ranks.main` (gspo_core/distributed.py), which `Ranks.lead` reads.
RANK_FREE = (
    "gspo_core/loop.py",
    "gspo_core/gspo_loop.py",
    "gspo_core/trainer.py",
    "gspo_core/sft.py",
    "gspo_core/checkpoint.py",
    *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "gspo_core" / "primitives").glob("*.py")),
)


def test_the_job_loop_checkpoints_and_primitives_never_test_the_rank():
    bad = []
    for name in RANK_FREE:
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "main":
                bad.append(f"{name}:{node.lineno} reads .main")
            if isinstance(node, ast.Compare) and any(_is_process_rank(part) for part in ast.walk(node)):
                bad.append(f"{name}:{node.lineno} compares a rank")
            if isinstance(node, ast.Attribute) and node.attr == "get_rank":
                bad.append(f"{name}:{node.lineno} reads the process group's rank")
    assert not bad, "\n".join(bad)


def _is_process_rank(node: ast.AST) -> bool:
    """``<x>.rank`` where it is the process's rank (a LoRA adapter's ``lora.rank`` is its size, not a rank)."""
    return isinstance(node, ast.Attribute) and node.attr == "rank" and "lora" not in ast.unparse(node.value)

"""The API's layers as the routers promise (read from the source): routes parse, call a service and
shape the response; services own the queries and the commits; every function says what it returns."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[2] / "api"
ROUTERS = sorted((API / "routers").glob("*.py"))
SERVICES = sorted((API / "services").glob("*.py"))
#: What a router may import besides the standard library: the web framework, and the API's own layers.
ROUTER_IMPORTS = (
    "fastapi",
    "prometheus_client",
    "api.bodies",
    "api.deps",
    "api.schemas",
    "api.openai_schemas",
    "api.job_schemas",
    "api.tinker_schemas",
    "api.services",
)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", ROUTERS, ids=lambda p: p.name)
def test_routers_reach_data_only_through_services(path):
    tree = _tree(path)
    stdlib = {"__future__", "pathlib", "typing"}
    bad = [n for n in _imported(tree) if n not in stdlib and not n.startswith(ROUTER_IMPORTS)]
    assert not bad, f"{path.name} imports {bad}: queries and stores belong to a service"
    touches_state = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "state"]
    assert not touches_state, f"{path.name}:{touches_state} reads app.state (take an Annotated dependency)"


@pytest.mark.parametrize("path", ROUTERS + SERVICES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_functions_annotate_their_returns(path):
    missing = [
        f"{path.name}:{node.lineno} {node.name}"
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is None
    ]
    assert not missing, f"no return annotation: {missing}"


@pytest.mark.parametrize("path", ROUTERS, ids=lambda p: p.name)
def test_routers_never_commit(path):
    """One owner per transaction: the service that writes commits (the session dependency never does)."""
    commits = [
        node.lineno
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Attribute) and node.attr in ("commit", "rollback")
    ]
    assert not commits, f"{path.name}:{commits}"


def test_the_session_dependency_does_not_commit():
    fn = next(
        n for n in ast.walk(_tree(API / "deps.py")) if isinstance(n, ast.AsyncFunctionDef) and n.name == "get_session"
    )
    assert not [n for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr == "commit"]

"""The app factory: the API's routes are built once per process and serve each app as `include_router` would."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.routing import APIRoute

from api.app import ERROR_RESPONSES, ROUTERS, create_app
from store.settings import Settings


def own_settings(tmp_path, name: str) -> Settings:
    """Settings of an app of its own (not the package fixture `settings`, which runs each test on two databases)."""
    return Settings(data_dir=tmp_path / name, database_url=f"sqlite:///{tmp_path / name}.db", models_dir=tmp_path)


def route_table(app: FastAPI) -> list[tuple]:
    """The app's routes as a request is matched against them, leaving out FastAPI's own documentation routes."""
    docs = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    return [(r.path, sorted(getattr(r, "methods", None) or ()), r.name) for r in app.routes if r.path not in docs]


def test_apps_share_routes_that_are_what_include_router_builds(tmp_path):
    """Two apps of one process hold the same route objects (built once: `include_router` builds every route anew
    in each app), and their OpenAPI document and route table are those of an app that includes the routers."""
    first, second = create_app(own_settings(tmp_path, "a")), create_app(own_settings(tmp_path, "b"))
    ours = [r for r in first.routes if isinstance(r, APIRoute)]
    assert len(ours) > 50 and all(any(r is s for s in second.routes) for r in ours)
    reference = FastAPI(
        title=first.title, version=first.version, description=first.description, responses=ERROR_RESPONSES
    )
    for router in ROUTERS:
        reference.include_router(router)
    assert first.openapi() == reference.openapi()
    assert route_table(first)[:-1] == route_table(reference)  # then the /static mount
    assert route_table(first)[-1][0] == "/static"

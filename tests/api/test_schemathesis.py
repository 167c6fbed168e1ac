"""Property-based API fuzzing against the app's own OpenAPI schema: no 5xx, responses match the schema."""

from __future__ import annotations

import tempfile
from pathlib import Path

import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance, status_code_conformance
from hypothesis import HealthCheck, settings as hsettings

from api.app import create_app
from gspo_core.toy import build_tiny_model, write_toy_dataset
from store.db import run_migrations
from store.settings import Settings
from store.tenants import create_tenant_and_key

_dir = Path(tempfile.mkdtemp(prefix="gspo-schemathesis-"))
_settings = Settings(data_dir=_dir, database_url=f"sqlite:///{_dir / 'gspo.db'}", models_dir=_dir / "models")
_state: dict = {}


def _app():
    run_migrations(_settings.resolved_database_url())
    build_tiny_model(_settings.models_dir / "toy")
    app = create_app(_settings)
    with app.state.db.session() as s:
        _, _state["key"] = create_tenant_and_key(s, "fuzz")
    return app


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@schema.parametrize()
@hsettings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case):
    # The bar: zero 5xx and every response valid against the schema (status and body).
    case.call_and_validate(headers={"Authorization": f"Bearer {_state['key']}"},
                           checks=[not_a_server_error, response_schema_conformance, status_code_conformance,
                                   content_type_conformance])

"""Property-based API fuzzing against the app's own OpenAPI schema: no 5xx, responses match the schema.

Every other case has its ids swapped for those of a real file, finished job and checkpoint of the
fuzzing tenant, so query parameters and bodies are fuzzed against live resources, not only 404s.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from gspo_core.toy import TOY_REWARD, build_tiny_model, write_toy_dataset
from store import jobs, progress
from store.db import run_migrations
from store.models import File, Job
from store.objects import put_dir
from store.settings import Settings
from store.tenants import create_tenant_and_key

_dir = Path(tempfile.mkdtemp(prefix="gspo-schemathesis-"))
_settings = Settings(data_dir=_dir, database_url=f"sqlite:///{_dir / 'gspo.db'}", models_dir=_dir / "models")
_alternate = itertools.count()


def seed_tenant(app, name: str) -> dict:
    """A tenant of its own (``key``) with a file, a succeeded job with metrics/samples and a checkpoint (``ids``),
    written as the worker writes them. Each fuzzing module seeds its own: the fuzzer deletes what it is given
    (a file, a job), which must not reach another module's cases (it made their jobs 404 on the file)."""
    data = write_toy_dataset(_dir / "toy.jsonl", n=8).read_bytes()
    ckpt = Path(tempfile.mkdtemp(dir=_dir, prefix="ckpt-"))
    (ckpt / "model").mkdir()
    (ckpt / "model" / "config.json").write_text("{}")
    with app.state.db.session() as s:
        tenant, key = create_tenant_and_key(s, name)
        f = File(
            tenant_id=tenant.id,
            filename="toy.jsonl",
            bytes=len(data),
            rows=8,
            object_key=f"tenants/{tenant.id}/files/toy.jsonl",
            item_fields=["answer", "prompt", "target"],
        )
        app.state.objects.put_bytes(f.object_key, data)
        s.add(f)
        s.flush()
        job = jobs.create_job(
            s,
            tenant_id=tenant.id,
            model="toy",
            training_file_id=f.id,
            reward=TOY_REWARD,
            hyperparameters={},
            total_steps=2,
        )
        s.commit()
        jobs.claim(s, job.id, "fuzz-worker", 30)
        for step in (1, 2):
            progress.record_step(s, job.id, step, {"reward/mean": step / 10})
            progress.record_samples(s, job.id, step, [{"prompt": "say a:", "item": {}, "completions": []}])
        size = put_dir(app.state.objects, f"jobs/{job.id}/checkpoints/step-000002", ckpt)
        c = progress.record_checkpoint(s, job, 2, f"jobs/{job.id}/checkpoints/step-000002", size, True)
        jobs.transition(s, s.get(Job, job.id), "succeeded")  # terminal, so its event stream ends
        return {"key": key, "ids": {"file_id": f.id, "job_id": job.id, "checkpoint_id": c.id}}


def _app():
    run_migrations(_settings.resolved_database_url())
    build_tiny_model(_settings.models_dir / "toy")
    return create_app(_settings)


#: The app the fuzzing modules share (tests/api/test_numeric_bounds.py fuzzes its numeric fields too), each with
#: a tenant of its own (seed_tenant).
APP = _app()
_state = seed_tenant(APP, "fuzz")
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


def _use_real_ids(case) -> None:
    if next(_alternate) % 2:
        return
    for name in list(case.path_parameters or {}):
        if name in _state["ids"]:
            case.path_parameters[name] = _state["ids"][name]
    if isinstance(case.body, dict) and "training_file" in case.body:
        case.body["training_file"] = _state["ids"]["file_id"]


@schema.parametrize()
@hsettings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case):
    _use_real_ids(case)
    # The bar: zero 5xx and every response valid against the schema (status and body).
    case.call_and_validate(
        headers={"Authorization": f"Bearer {_state['key']}"},
        checks=[not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance],
    )

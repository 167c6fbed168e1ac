"""A job's hyperparameters at submit: registry names, strict types, operator settings refused, and their
schema visible in OpenAPI."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from store.models import Job
from tests.api.conftest import job_body


def _jobs(app) -> int:
    with app.state.db.session() as s:
        return s.scalar(select(func.count()).select_from(Job))


def _post_raw(client, auth, body_text: str):
    return client.post("/v1/jobs", content=body_text.encode(), headers={**auth, "Content-Type": "application/json"})


@pytest.mark.parametrize(
    "name,value,known", [("loss", "ppo", ["gspo", "gspo_token", "grpo"]), ("advantage", "rloo", ["group_norm"])]
)
def test_unknown_registry_names_are_refused_listing_the_known_ones(
    client, app, auth, uploaded, model_name, name, value, known
):
    r = client.post("/v1/jobs", json=job_body(uploaded["id"], **{name: value}), headers=auth)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == f"hyperparameters.{name}" and all(k in err["message"] for k in known), err
    assert _jobs(app) == 0


@pytest.mark.parametrize(
    "hp_text,field",
    [
        ('"steps": true', "steps"),
        ('"learning_rate": false', "learning_rate"),
        ('"learning_rate": NaN', "learning_rate"),
        ('"temperature": Infinity', "temperature"),
        ('"max_grad_norm": -Infinity', "max_grad_norm"),
        ('"shuffle": 1', "shuffle"),
        ('"rollout_engine": "vllm"', "rollout_engine"),  # the operator's setting, not the tenant's
        ('"cpu_gemm": "onednn"', "cpu_gemm"),
        ('"save_merged": false', "save_merged"),
    ],
)
def test_strict_types_and_operator_settings_are_refused_naming_the_field(
    client, app, auth, uploaded, model_name, hp_text, field
):
    body = {k: v for k, v in job_body(uploaded["id"]).items() if k != "hyperparameters"}
    r = _post_raw(client, auth, json.dumps(body)[:-1] + ', "hyperparameters": {' + hp_text + "}}")
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == f"hyperparameters.{field}", r.json()
    assert _jobs(app) == 0


def test_a_stored_job_holds_only_the_algorithms_fields(client, app, auth, uploaded, model_name):
    r = client.post("/v1/jobs", json=job_body(uploaded["id"], steps=3, learning_rate=1e-4), headers=auth)
    assert r.status_code == 201, r.text
    hp = r.json()["hyperparameters"]
    assert hp["steps"] == 3 and hp["learning_rate"] == 1e-4
    assert not {
        "rollout_engine",
        "vllm_gpu_memory_utilization",
        "keep_freed_memory",
        "cpu_gemm",
        "beta",
        "lora_dropout",
        "save_merged",
    } & set(hp)


def test_openapi_shows_every_hyperparameter_with_its_description_and_bounds(client):
    from gspo_core.config import GSPOConfig

    schema = client.get("/openapi.json").json()["components"]["schemas"]["JobCreate"]["properties"]["hyperparameters"]
    props = schema["properties"]
    assert set(props) == set(GSPOConfig.model_fields) and "required" not in schema
    assert schema.get("additionalProperties") is False
    assert all(p.get("description") for p in props.values()), [n for n, p in props.items() if not p.get("description")]
    assert props["steps"]["minimum"] == 1 and props["steps"]["maximum"] == 1_000_000
    assert props["learning_rate"]["exclusiveMinimum"] == 0 and props["learning_rate"]["type"] == "number"
    assert props["loss"]["enum"] == ["gspo", "gspo_token", "grpo"] and props["loss"]["default"] == "gspo"
    assert props["minibatch_order"]["enum"] == ["length", "group", "random"]


def test_a_retry_of_a_job_stored_with_retired_keys_is_still_the_same_request(client, app, auth, uploaded, model_name):
    h = {**auth, "Idempotency-Key": "old-1"}
    first = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=h)
    assert first.status_code == 201, first.text
    with app.state.db.session() as s:  # as the version before stored it: with the operator's keys
        job = s.get(Job, first.json()["id"])
        job.hyperparameters = {**job.hyperparameters, "rollout_engine": "auto", "cpu_gemm": "auto", "beta": 0.0}
        s.commit()
    again = client.post("/v1/jobs", json=job_body(uploaded["id"]), headers=h)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text
    assert _jobs(app) == 1

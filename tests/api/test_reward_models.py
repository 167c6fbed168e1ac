"""``reward_model`` graders name models under the same policy as the trained model, at submit time
and in /v1/rewards/run (which loads them in the API process)."""

from __future__ import annotations

import pytest

from gspo_core.rewards import build_reward
from gspo_core.toy import build_tiny_reward_model
from tests.api.conftest import job_body


@pytest.fixture()
def outside_model(tmp_path_factory):
    """A real model directory that is NOT under the models directory."""
    return build_tiny_reward_model(tmp_path_factory.mktemp("elsewhere"))


def _rm(model: str) -> dict:
    return {"type": "reward_model", "name": "rm", "model": model}


@pytest.mark.parametrize("where", ["abs", "dotdot", "unknown", "hub_refused"])
def test_grader_model_outside_the_policy_is_refused(client, app, auth, uploaded, model_name, outside_model, where):
    if where == "hub_refused":
        app.state.settings.allow_hub_models = False
    model = {
        "abs": str(outside_model),
        "dotdot": f"../../{outside_model.name}",
        "unknown": "not-a-model",
        "hub_refused": "org/reward-model",
    }[where]
    nested = {"type": "multi", "graders": {"exact": {"type": "regex", "pattern": "a"}, "rm": _rm(model)}}
    for spec, field in ((_rm(model), "reward.model"), (nested, "reward.graders.rm.model")):
        r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "reward": spec}, headers=auth)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == field and r.json()["error"]["type"] == "invalid_reward"
        r = client.post("/v1/rewards/run", json={"reward": spec, "samples": ["x"]}, headers=auth)
        assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text


def test_grader_model_under_the_models_dir_is_found_by_name(client, settings, auth, uploaded, model_name):
    path = build_tiny_reward_model(settings.models_dir / "rm")
    r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "reward": _rm("rm")}, headers=auth)
    assert r.status_code == 201, r.text
    assert r.json()["reward"]["model"] == "rm"  # stored as named; the worker resolves it the same way
    texts = ["hello", "a longer text"]
    r = client.post(
        "/v1/rewards/run", json={"reward": _rm("rm"), "item": {"prompt": "Q: "}, "samples": texts}, headers=auth
    )
    assert r.status_code == 200, r.text
    direct = build_reward(_rm(str(path)))
    try:
        want = [
            g.reward
            for g in direct.score_batch(
                [{"prompt": "Q: "}] * 2,
                [{"output_text": t, "output_tokens": len(t), "finish_reason": "stop"} for t in texts],
            )
        ]
    finally:
        direct.close()
    got = r.json()["results"]
    assert [x["reward"] for x in got] == pytest.approx(want) and not any(x["errors"] for x in got)

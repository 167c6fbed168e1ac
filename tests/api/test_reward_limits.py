"""Reward specs at the API: internal grader URLs and oversized, deep or non-finite specs are 422s naming
the field (at submit and in /v1/rewards/run); the operator's allow-list opens a target; reward models
are loaded once per process, however many dry runs ask for them."""

from __future__ import annotations

import json
import os
import threading

import pytest

from gspo_core.rewards.reward_model import MODEL_CACHE
from gspo_core.toy import build_tiny_reward_model
from tests.api.conftest import job_body
from tests.core.net_support import Listener, Server, loopback_name


def _run(client, auth, spec, samples=("abcd",), item=None):
    return client.post(
        "/v1/rewards/run", json={"reward": spec, "item": item or {}, "samples": list(samples)}, headers=auth
    )


def test_internal_grader_urls_are_refused_naming_the_field(client, auth, uploaded):
    lst = Listener()
    try:
        judge = {
            "type": "score_model",
            "base_url": f"http://[::ffff:127.0.0.1]:{lst.port}/v1",
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
        }
        cases = [
            ({"type": "http", "url": f"http://2130706433:{lst.port}/score"}, "reward.url"),
            (judge, "reward.base_url"),
            (
                {"type": "multi", "graders": {"h": {"type": "http", "url": "http://169.254.169.254/latest"}}},
                "reward.graders.h.url",
            ),
            (
                {"type": "http", "url": "https://rm.example/score", "headers": {"Host": "internal"}},
                "reward.headers.Host",
            ),
        ]
        for spec, field in cases:
            r = _run(client, auth, spec)
            assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
            r = client.post("/v1/jobs", json={**job_body(uploaded["id"]), "reward": spec}, headers=auth)
            assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
        assert lst.accepted == 0
    finally:
        lst.close()


def test_names_resolving_inside_are_refused_at_run_time_unless_allowed(client, app, auth):
    name, addr = loopback_name()
    srv = Server(addr, {"/score": (200, {}, b'{"reward": 0.75}')})
    try:
        spec = {"type": "http", "name": "h", "url": f"http://{name}:{srv.port}/score", "retries": 0}
        r = _run(client, auth, spec)
        assert r.status_code == 200, r.text
        res = r.json()["results"][0]
        assert res["reward"] == 0.0 and res["errors"]["h"].startswith("egress_refused:") and not srv.requests
        app.state.settings.egress_allow = f"example.org, {addr}"  # GSPO_EGRESS_ALLOW
        r = _run(client, auth, spec)
        assert r.status_code == 200 and r.json()["results"][0]["reward"] == 0.75, r.text
        assert len(srv.requests) == 1
    finally:
        srv.close()


def _nested_multi(depth: int) -> dict:
    spec: dict = {"type": "length", "target": 1}
    for _ in range(depth):
        spec = {"type": "multi", "graders": {"g": spec}}
    return spec


@pytest.mark.parametrize(
    "spec,field",
    [
        (_nested_multi(300), None),
        (
            {
                "type": "multi",
                "graders": {"a": {"type": "length", "target": 1}},
                "calculate_output": "+".join(["a"] * 900),
            },
            "reward.calculate_output",
        ),
        ({"type": "python", "source": "def grade(s, i):\n    return " + "-" * 50000 + "1\n"}, "reward.source"),
        ({"type": "length", "target": True}, "reward.target"),
    ],
)
def test_deep_and_oversized_specs_are_422s(client, auth, uploaded, spec, field):
    for r in (
        _run(client, auth, spec),
        client.post("/v1/jobs", json={**job_body(uploaded["id"]), "reward": spec}, headers=auth),
    ):
        assert r.status_code == 422, r.text
        got = r.json()["error"]["field"]
        assert got == field if field else got.startswith("reward.graders.g.graders.g."), got


def test_non_finite_numbers_are_422s(client, auth):
    """NaN and Infinity are JSON extensions Python's parser accepts: they reach the spec unless refused."""
    body = (
        '{"reward": {"type": "multi", "graders": {"m": {"type": "math_answer", "reference": "1", '
        '"tolerance": NaN}}}, "samples": ["1"]}'
    )
    r = client.post("/v1/rewards/run", content=body, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "reward.graders.m.tolerance", r.text
    body = '{"reward": {"type": "json_schema", "schema": {"maximum": -Infinity}}, "samples": ["1"]}'
    r = client.post("/v1/rewards/run", content=body, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "reward.schema.maximum", r.text


def test_reward_model_dry_runs_load_the_model_once(client, settings, auth):
    build_tiny_reward_model(settings.models_dir / "rm")
    spec = {"type": "reward_model", "name": "rm", "model": "rm"}
    MODEL_CACHE.clear()
    loads = MODEL_CACHE.loads
    out: list = []

    def ask(text: str) -> None:
        r = _run(client, auth, spec, samples=[text], item={"prompt": "Q: "})
        out.append((r.status_code, r.json()["results"][0]))

    threads = [threading.Thread(target=ask, args=(f"text {i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ask("text 0")
    assert [s for s, _ in out] == [200] * 5 and not any(res["errors"] for _, res in out), json.dumps(out)
    assert MODEL_CACHE.loads == loads + 1  # five requests, four of them at once: one load
    scores = {res["output_text"]: res["reward"] for _, res in out}
    assert len(scores) == 4 and 0 < scores["text 0"] < 1


def test_dry_runs_grade_below_the_api_s_priority(client, auth):
    """A python grader's sandbox and the grader pool run at the operator's dry-run niceness (default 19)."""
    probe = "import os\ndef grade(sample, item):\n    return float(os.getpriority(os.PRIO_PROCESS, 0))"
    spec = {
        "type": "multi",
        "graders": {
            "py": {"type": "python", "source": probe},
            "sim": {"type": "text_similarity", "reference": "a", "evaluation_metric": "fuzzy_match"},
        },
        "calculate_output": "py",
    }
    r = client.post("/v1/rewards/run", json={"reward": spec, "samples": ["a"]}, headers=auth)
    assert r.status_code == 200, r.text
    want = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 19)  # relative to the API's own (this process's)
    assert r.json()["results"][0]["scores"]["py"] == want
    from gspo_core.rewards.pool import _POOLS

    niced = [pool for key, pool in _POOLS.items() if key[2] == 19]
    assert niced and all(os.getpriority(os.PRIO_PROCESS, pid) == want for pool in niced for pid in pool.pids())

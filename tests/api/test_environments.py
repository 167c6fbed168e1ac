"""Jobs on environments through the API: 422s naming the field, the grader in `/v1/rewards/run`, jobs through the
live `gspo api` + `gspo worker` (reasoning-gym with its held-out evaluation, verifiers, a real OpenEnv server), and
hostile configs stopped in the grader pool within the operator's time while the service answers others."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from gspo_client import Client
from gspo_core.environments import check_environment, environment_rows
from gspo_core.rewards.pool import GRACE_S
from store.models import Job
from store.settings import Settings
from tests.conftest import empty_database_url
from tests.support.openenv_support import OPENENV_HOST, TOKEN, OpenEnvServer, step_reward
from tests.support.verifiers_support import envs_python

pytest.importorskip("reasoning_gym")

ENV = {
    "type": "reasoning_gym",
    "tasks": [{"name": "basic_arithmetic", "config": {"max_terms": 2, "max_digits": 1}}],
    "seed": 7,
    "size": 16,
    "validation_size": 4,
    "system_prompt": None,  # the toy model's context is short: the question alone
}


#: GSPO_ENVIRONMENT_CHECK_TIMEOUT_S of these tests' API (the in-process one, and the live `service`'s).
CHECK_S = 3.0


def looping(digits: int) -> dict:
    """basic_arithmetic dividing by trial: its generator tries every divisor below 10**digits, in Python (12
    digits: hours for one item; 6: a few milliseconds)."""
    config = {"min_terms": 2, "max_terms": 2, "min_digits": digits, "max_digits": digits, "operators": ["/"]}
    return {"name": "basic_arithmetic", "config": {**config, "allow_parentheses": False}}


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path):
    """tests/api/conftest.py's, with the dry runs' grader processes at normal priority: a fresh one imports
    reasoning-gym (seconds), which niceness 19 stretches past the dry run's budget on a loaded shared machine
    (the niceness itself is tested in test_reward_limits.py)."""
    return Settings(
        data_dir=tmp_path,
        database_url=empty_database_url(request, tmp_path),
        models_dir=tmp_path / "models",
        max_upload_bytes=200_000,
        max_file_rows=500,
        dry_run_niceness=0,
        environment_check_timeout_s=CHECK_S,
        grader_local_timeout_s=2.0,
    )


#: A tenant's OpenEnv server (never contacted at submit: only its address and headers are checked).
OPENENV = {
    "type": "openenv",
    "url": "https://env.example.com/guess",
    "headers": {"Authorization": "Bearer tenant-secret"},
    "max_turns": 4,
    "size": 8,
}
HP = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "mini_batches": 1, "max_new_tokens": 4, "eval_prompts": 4}


@pytest.mark.parametrize(
    "change,field,message",
    [
        ({"environment": {**ENV, "tasks": [{"name": "arithmetic"}]}}, "environment.tasks[0].name", "known: "),
        (
            {"environment": {**ENV, "tasks": [{"name": "chain_sum", "config": {"digits": 2}}]}},
            "environment.tasks[0].config.digits",
            "known: .*min_digits",
        ),
        ({"environment": {**OPENENV, "url": "http://127.0.0.1:8000"}}, "environment.url", "loopback"),
        ({"environment": {**OPENENV, "url": "http://169.254.169.254/"}}, "environment.url", "not reachable"),
        ({"environment": {**OPENENV, "url": "ftp://env.example.com"}}, "environment.url", "http"),
        ({"environment": {**OPENENV, "headers": {"Host": "x"}}}, "environment.headers.Host", "Host"),
        ({"environment": {**OPENENV, "max_turns": 65}}, "environment.max_turns", "less than or equal"),
        ({"environment": {**OPENENV, "size": 501}}, "environment.size", "GSPO_MAX_FILE_ROWS"),
        (
            {"environment": OPENENV, "tools": [{"type": "agent", "server_url": "https://agent.example.com"}]},
            "tools",
            "give no tools",
        ),
        (
            {"environment": {"type": "verifiers", "id": "vf_toy"}},
            "environment.id",
            "'vf_toy' is not an allowed environment .allowed: none",
        ),
        ({"environment": {"type": "verifiers", "id": "vf_toy", "module": "os"}}, "environment.module", "Extra"),
        ({"environment": {**ENV, "size": 501}}, "environment.size", "GSPO_MAX_FILE_ROWS"),
        ({"environment": None}, "training_file", "required unless an environment"),
        ({"training_file": "file_x"}, "training_file", "files or an environment, not both"),
        (
            {"reward": {"type": "string_check", "input": "{{item.target}}", "reference": "a", "operation": "eq"}},
            "reward",
            "target",
        ),
        ({"hyperparameters": {**HP, "method": "supervised"}}, "environment", "supervised"),
    ],
)
def test_bad_environment_jobs_are_422s_naming_the_field(client, auth, model_name, change, field, message):
    body = {"model": model_name, "environment": ENV, "hyperparameters": HP, **change}
    r = client.post("/v1/jobs", json=body, headers=auth)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == field
    assert re.search(message, error["message"]), error


def test_openapi_shows_the_environment_types_whole(client):
    """The request schema holds each environment type's fields in place (no reference to a missing $defs)."""
    schema = client.get("/openapi.json").json()["components"]["schemas"]["JobCreate"]["properties"]["environment"]
    text = json.dumps(schema)
    assert "$ref" not in text and '"reasoning_gym"' in text and "validation_size" in text and "weight" in text


def test_an_openenv_job_takes_the_servers_reward_and_never_shows_its_headers(client, auth, model_name):
    """The job's reward is the server's (`openenv`); JobOut and the environment's page redact the headers; the
    rows are the reset seeds."""
    r = client.post("/v1/jobs", json={"model": model_name, "environment": OPENENV, "hyperparameters": HP}, headers=auth)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["reward"] == {"type": "openenv"} and "tenant-secret" not in r.text
    assert job["environment"]["headers"] == {"Authorization": "[redacted]"} and job["environment"]["max_turns"] == 4
    shown = client.get(f"/v1/jobs/{job['id']}/environment?samples=2", headers=auth)
    assert "tenant-secret" not in shown.text and "tenant-secret" not in client.get("/v1/jobs", headers=auth).text
    assert [item["seed"] for item in shown.json()["samples"]] == [0, 1]


def test_an_environment_job_takes_the_tasks_own_scorer_and_shows_its_items(client, auth, model_name):
    r = client.post("/v1/jobs", json={"model": model_name, "environment": ENV, "hyperparameters": HP}, headers=auth)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["environment"] == ENV and job["training_file"] is None
    assert job["reward"] == {"type": "reasoning_gym", "name": "answer"}
    assert job["evaluation"] == {"before": None, "after": None}
    shown = client.get(f"/v1/jobs/{job['id']}/environment?samples=2", headers=auth).json()
    assert shown["environment"] == ENV and len(shown["samples"]) == 2
    item = shown["samples"][0]
    assert item["task"] == "basic_arithmetic" and item["messages"] == [{"role": "user", "content": item["question"]}]
    # The grader scores the item's answer with its task's scorer, beside a format grader in `multi`.
    reward = {
        "type": "multi",
        "graders": {"answer": {"type": "reasoning_gym"}, "tagged": {"type": "regex", "pattern": "</answer>"}},
        "calculate_output": "answer + 0.1 * tagged",
    }
    samples = [f"<answer>{item['answer']}</answer>", f"so\n{item['answer']}", "<answer>x</answer>"]
    r = client.post("/v1/rewards/run", json={"reward": reward, "item": item, "samples": samples}, headers=auth)
    assert r.status_code == 200, r.text
    assert [round(res["reward"], 6) for res in r.json()["results"]] == [1.1, 1.0, 0.1]
    bad = client.post(
        "/v1/rewards/run",
        json={"reward": {"type": "reasoning_gym", "extract": "first_line"}, "item": item, "samples": ["1"]},
        headers=auth,
    )
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "reward.extract"


def test_a_job_on_an_environment_runs_with_its_evaluation_before_and_after(service):
    """Through the live API and worker (the client): the environment's items are trained on, the held-out
    split is evaluated at step 0 and after the last step, and JobOut, the metrics, the OpenAI events and the
    checkpoints show before -> after."""
    url, keys, tmp = service
    with Client(url, keys[1]) as c:
        job = c.create_job(model="toy", environment=ENV, hyperparameters={**HP, "save_every": 1})
        deadline = time.monotonic() + 300
        while (job := c.get_job(job["id"]))["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, (tmp / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
        assert job["status"] == "succeeded", (job, (tmp / "worker.log").read_text()[-3000:])
        before, after = job["evaluation"]["before"], job["evaluation"]["after"]
        assert (before["step"], after["step"], before["prompts"], after["prompts"]) == (0, 2, 4, 4)
        for point in (before, after):
            assert 0 <= point["greedy_reward"] <= 1 and 0 <= point["sampled_reward"] <= 1
        steps = {row["step"]: row["metrics"] for row in c.metrics(job["id"])}
        assert sorted(steps) == [0, 1, 2]
        assert steps[0]["eval/greedy/reward/mean"] == before["greedy_reward"]
        assert steps[2]["eval/greedy/reward/mean"] == after["greedy_reward"]
        assert steps[0]["eval/reward/mean"] == before["sampled_reward"] and "reward/answer/mean" in steps[1]
        ckpts = c.list_checkpoints(job["id"])
        assert {k["step"]: "eval/greedy/reward/mean" in k["metrics"] for k in ckpts} == {2: True, 1: False}
        samples = c.get_environment(job["id"], samples=1)["samples"]
    events = httpx.get(
        f"{url}/v1/fine_tuning/jobs/{job['id']}/events?limit=100", headers={"Authorization": f"Bearer {keys[1]}"}
    ).json()["data"]
    messages = [e["message"] for e in events]
    assert any(m.startswith("Held-out evaluation before training, full_valid_greedy_mean_reward=") for m in messages)
    after_line = f"{before['greedy_reward']:.4f} → {after['greedy_reward']:.4f}"
    assert any(
        m.startswith("held-out evaluation after training (4 prompts): greedy reward") and after_line in m
        for m in messages
    ), messages
    # The rollouts' items are the environment's training items (the same ones this process generates).
    train, held_out = environment_rows(check_environment(ENV))
    assert samples == train[:1]
    trained = [row["item"] for step in (1, 2) for row in _samples(url, keys[1], job["id"], step)]
    assert trained and all(item in train and item not in held_out for item in trained)


def test_a_preview_that_does_not_generate_in_time_is_a_422_naming_samples(client, app, auth, model_name):
    """A stored job whose items no longer generate within the time (its environment made slow here, as an
    operator's lower limit would): its preview is a 422 within the time, not a request thread held for hours."""
    r = client.post("/v1/jobs", json={"model": model_name, "environment": ENV, "hyperparameters": HP}, headers=auth)
    assert r.status_code == 201, r.text
    with app.state.db.session() as s:
        s.get(Job, r.json()["id"]).environment = {**ENV, "tasks": [looping(12)]}
    started = time.monotonic()
    shown = client.get(f"/v1/jobs/{r.json()['id']}/environment?samples=2", headers=auth)
    assert time.monotonic() - started < CHECK_S + GRACE_S + 2.0
    assert shown.status_code == 422, shown.text
    assert shown.json()["error"]["field"] == "samples"
    assert "generating 2 items took longer than 3 s (the operator's GSPO_ENVIRONMENT_CHECK_TIMEOUT_S)" in shown.text


def test_a_dry_run_s_reasoning_gym_scorer_that_never_ends_scores_a_timeout(client, auth):
    """countdown's scorer evaluates the answer with sympy: a power tower runs for hours. In `/v1/rewards/run` it
    is stopped at the pool's per-sample time and recorded as the grader's error; the other sample scores."""
    item = {"task": "countdown", "answer": "1 + 2", "metadata": {"numbers": [1, 2], "target": 3}}
    samples = ["<answer>9**9**9**9</answer>", "<answer>1 + 2</answer>"]
    body = {"reward": {"type": "reasoning_gym"}, "item": item, "samples": samples}
    client.post("/v1/rewards/run", json={**body, "samples": samples[1:]}, headers=auth)  # the scorer's imports
    started = time.monotonic()
    r = client.post("/v1/rewards/run", json=body, headers=auth)
    assert time.monotonic() - started < 2.0 + GRACE_S + 3.0
    assert r.status_code == 200, r.text
    hung, right = r.json()["results"]
    assert hung["reward"] == 0 and hung["errors"]["reasoning_gym"].startswith("timeout"), hung
    assert right["reward"] == 1.0


def test_a_hostile_environment_is_a_422_within_the_time_while_the_service_answers(service):
    """Through the live API: a task whose first item never finishes generating is a 422 naming its config
    within GSPO_ENVIRONMENT_CHECK_TIMEOUT_S, and the API answers other requests meanwhile."""
    url, keys, _ = service
    headers = {"Authorization": f"Bearer {keys[3]}"}
    refused = {"type": "reasoning_gym", "tasks": [{"name": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}]}
    for _ in range(4):  # each grader process of the API holds reasoning-gym's imports (done outside the time)
        r = httpx.post(f"{url}/v1/jobs", json={"model": "toy", "environment": refused}, headers=headers, timeout=150)
        assert r.status_code == 422 and "max_terms" in r.text, r.text
    hostile = {**ENV, "tasks": [{"name": "chain_sum"}, looping(12)]}
    answer: list[httpx.Response] = []
    started = time.monotonic()
    thread = threading.Thread(
        target=lambda: answer.append(
            httpx.post(f"{url}/v1/jobs", json={"model": "toy", "environment": hostile}, headers=headers, timeout=60)
        )
    )
    thread.start()
    while thread.is_alive() and time.monotonic() - started < 60:
        asked = time.monotonic()
        assert httpx.get(f"{url}/v1/jobs?limit=1", headers=headers, timeout=10).status_code == 200
        assert time.monotonic() - asked < 2.0, "the API stalled behind the environment's check"
        time.sleep(0.2)
    thread.join()
    elapsed = time.monotonic() - started
    assert answer[0].status_code == 422, answer[0].text
    error = answer[0].json()["error"]
    assert error["field"] == "environment.tasks[1].config"
    assert "first item took longer than 3 s (the operator's GSPO_ENVIRONMENT_CHECK_TIMEOUT_S)" in error["message"]
    assert CHECK_S <= elapsed < CHECK_S + GRACE_S + 2.0, elapsed


def test_an_environment_that_does_not_generate_in_time_fails_its_job(service):
    """The first item generates at once (the check passes), the 2000 items do not within the worker's
    GSPO_ENVIRONMENT_GENERATE_TIMEOUT_S: the job fails saying so, and the worker runs the next job."""
    url, keys, tmp = service
    environment = {**ENV, "tasks": [looping(6)], "size": 2000, "validation_size": 0}
    with Client(url, keys[3]) as c:
        job = c.create_job(model="toy", environment=environment, hyperparameters=HP)
        deadline = time.monotonic() + 300
        while (job := c.get_job(job["id"]))["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, (tmp / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
    assert job["status"] == "failed"
    assert job["error"] == (
        "invalid job input: environment: generating the items took longer than 8 s (the operator's "
        "GSPO_ENVIRONMENT_GENERATE_TIMEOUT_S); ask for smaller values"
    ), job["error"]


def _samples(url: str, key: str, job_id: str, step: int) -> list[dict]:
    r = httpx.get(f"{url}/v1/jobs/{job_id}/samples?step={step}", headers={"Authorization": f"Bearer {key}"})
    return r.json()["rows"] if r.status_code == 200 else []


VF_ENV = {"type": "verifiers", "id": "vf_toy", "args": {"repeat": 1}, "size": 4}


def test_a_job_on_a_verifiers_environment_runs_through_the_service(service):
    """Through the live API and worker, whose operator allowed the test environment (tests/api/conftest.py): its
    rubric is the default reward, its episodes are in the inspector, its metrics in the job's, the job page's
    environment shows it; an id the operator did not allow is a 422 listing the allowed ones."""
    envs_python()
    url, keys, tmp = service
    auth = {"Authorization": f"Bearer {keys[3]}"}
    refused = httpx.post(
        f"{url}/v1/jobs",
        json={"model": "toy", "environment": {**VF_ENV, "id": "gsm8k"}, "hyperparameters": HP},
        headers=auth,
    )
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "environment.id"
    assert "(allowed: vf_toy)" in refused.json()["error"]["message"]
    with Client(url, keys[3]) as c:
        job = c.create_job(model="toy", environment=VF_ENV, hyperparameters={**HP, "steps": 1})
        assert job["reward"] == {"type": "verifiers", "name": "rubric"}
        deadline = time.monotonic() + 300
        while (job := c.get_job(job["id"]))["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, (tmp / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
        assert job["status"] == "succeeded", (job, (tmp / "worker.log").read_text()[-3000:])
        ((step, metrics),) = [(row["step"], row["metrics"]) for row in c.metrics(job["id"])]
        assert step == 1 and metrics["rollouts_dropped"] == 0
        assert metrics["reward/rubric/mean"] == pytest.approx(metrics["verifiers/said_it/mean"])
        assert c.get_environment(job["id"])["environment"] == VF_ENV
    rows = _samples(url, keys[3], job["id"], 1)
    assert rows and all(row["item"]["task"] == "vf_toy" for row in rows)
    for row in rows:
        for shown in row["completions"]:
            said = shown["messages"][-1]["content"]
            assert shown["reward"] == (1.0 if row["item"]["answer"] in said.lower() else 0.0)


@pytest.fixture
def live_guess_server(tmp_path):
    """The OpenEnv test server on the one loopback address the live service's egress allows (tests/api/conftest.py),
    refusing a WebSocket without the tenant's token."""
    server = OpenEnvServer(tmp_path / "openenv.log", "--token", TOKEN, host=OPENENV_HOST)
    yield server
    server.close()


def test_an_openenv_job_runs_through_the_service(service, live_guess_server):
    """Through the live API and worker: the worker reaches the tenant's server (sending its header, which the server
    requires) through the egress policy, the server's rewards are the job's (summed per episode), its observations
    are the inspector's transcripts, and the header is redacted everywhere the tenant can look; 127.0.0.1 stays
    refused in the same service."""
    url, keys, tmp = service
    auth = {"Authorization": f"Bearer {keys[3]}"}
    env = {
        "type": "openenv",
        "url": live_guess_server.url,
        "headers": {"Authorization": f"Bearer {TOKEN}"},
        "max_turns": 3,
        "observation_field": "prompt",
        "size": 4,
    }
    hp = {"steps": 1, "prompts_per_step": 2, "group_size": 2, "mini_batches": 1, "max_new_tokens": 48}
    hp["max_turn_tokens"] = 6
    refused = httpx.post(
        f"{url}/v1/jobs",
        json={"model": "toy", "environment": {**env, "url": f"http://127.0.0.1:{live_guess_server.port}"}},
        headers=auth,
    )
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "environment.url", refused.text
    with Client(url, keys[3]) as c:
        job = c.create_job(model="toy", environment=env, hyperparameters=hp)
        assert job["reward"] == {"type": "openenv"} and job["environment"]["headers"] == {"Authorization": "[redacted]"}
        deadline = time.monotonic() + 300
        while (job := c.get_job(job["id"]))["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, (tmp / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
        assert job["status"] == "succeeded", (job, (tmp / "worker.log").read_text()[-3000:])
        ((step, metrics),) = [(row["step"], row["metrics"]) for row in c.metrics(job["id"])]
        assert step == 1 and metrics["rollouts_dropped"] == 0 and metrics["openenv/steps"] == 8
        assert metrics["turns/mean"] == 2
        assert c.get_environment(job["id"])["environment"]["headers"] == {"Authorization": "[redacted]"}
    for path in (f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/environment", "/v1/jobs"):
        assert TOKEN not in httpx.get(url + path, headers=auth).text, path
    rows = _samples(url, keys[3], job["id"], 1)
    rewards = []
    for row in rows:
        seed = row["item"]["seed"]
        for shown in row["completions"]:
            users = [m["content"] for m in shown["messages"] if m["role"] == "user"]
            said = [m["content"] for m in shown["messages"] if m["role"] == "assistant"]
            assert users == [f"word {seed}?", f"again {seed}.1?"] and len(said) == 2 and not shown["dropped"]
            assert shown["reward"] == sum(map(step_reward, said))
            rewards.append(shown["reward"])
    assert len(rewards) == 4 and metrics["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))

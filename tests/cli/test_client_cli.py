"""The `gspo` client commands and the Python client against a real server (uvicorn) and worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest
import yaml

from gspo_core.toy import TOY_REWARD, write_toy_dataset
from tests.embedded_service import ROOT


def gspo(service, *args, key: str | None = None):
    url, default_key, *_ = service
    env = {**os.environ, "GSPO_BASE_URL": url, "GSPO_API_KEY": key or default_key, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "gspo_cli.main", *args], capture_output=True, text=True, env=env, timeout=180, cwd=ROOT
    )


def test_files_jobs_metrics_checkpoints(embedded_service, tmp_path):
    _, _, job_id, *_ = embedded_service
    data = write_toy_dataset(tmp_path / "toy.jsonl", n=8)
    up = gspo(embedded_service, "files", "upload", str(data))
    assert up.returncode == 0, up.stderr
    file_id = json.loads(up.stdout)["id"]
    assert file_id in gspo(embedded_service, "files", "list").stdout
    listing = gspo(embedded_service, "jobs", "list", "--status", "succeeded")
    assert job_id in listing.stdout and "12/12" in listing.stdout
    assert json.loads(gspo(embedded_service, "jobs", "get", job_id).stdout)["status"] == "succeeded"
    csv = gspo(embedded_service, "jobs", "metrics", job_id, "--csv").stdout.splitlines()
    assert csv[0].startswith("step,") and len(csv) == 13
    watch = gspo(embedded_service, "jobs", "watch", job_id)
    assert watch.returncode == 0 and "succeeded at step 12/12" in watch.stdout and "reward" in watch.stdout
    ckpts = gspo(embedded_service, "checkpoints", "list", job_id).stdout.splitlines()
    assert len(ckpts) == 2 and "final" in ckpts[-1]
    out = tmp_path / "c.tar.gz"
    dl = gspo(embedded_service, "checkpoints", "download", ckpts[-1].split()[0], "-o", str(out))
    assert dl.returncode == 0 and "verified" in dl.stdout
    with tarfile.open(out) as tar:
        assert any(n.endswith("model/config.json") for n in tar.getnames())


def test_jobs_create_from_file_with_set_and_cancel(embedded_service, tmp_path):
    data = write_toy_dataset(tmp_path / "toy.jsonl", n=8)
    file_id = json.loads(gspo(embedded_service, "files", "upload", str(data)).stdout)["id"]
    spec = tmp_path / "job.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": "toy",
                "training_file": file_id,
                "reward": TOY_REWARD,
                "hyperparameters": {"steps": 500, "group_size": 4, "prompts_per_step": 2},
            }
        )
    )
    created = gspo(embedded_service, "jobs", "create", str(spec), "--set", "group_size=8", "--name", "from-file")
    assert created.returncode == 0, created.stderr
    job = json.loads(created.stdout)
    assert job["hyperparameters"]["group_size"] == 8 and job["name"] == "from-file"
    cancel = gspo(embedded_service, "jobs", "cancel", job["id"])
    assert cancel.returncode == 0 and cancel.stdout.strip() in ("cancelled", "cancelling")


def test_api_errors_are_messages_not_tracebacks(embedded_service, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "a"}\n{"oops": 1}\n')
    r = gspo(embedded_service, "files", "upload", str(bad))
    assert r.returncode == 1 and "line 2" in r.stderr and "Traceback" not in r.stderr
    r = gspo(embedded_service, "jobs", "get", "job_missing")
    assert r.returncode == 1 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = gspo(embedded_service, "jobs", "list", key="wrong")
    assert r.returncode == 1 and "401" in r.stderr
    r = gspo(embedded_service, "jobs", "create", "--model", "toy")
    assert r.returncode == 1 and "missing" in r.stderr


def test_python_client_errors(embedded_service):
    from gspo_client import ApiError, Client

    url, key, job_id, *_ = embedded_service
    with Client(url, key) as c:
        with pytest.raises(ApiError) as exc:
            c.create_job(model="toy", training_file="file_nope", reward=TOY_REWARD)
        assert exc.value.status == 404 and exc.value.field == "training_file"
        assert c.samples(job_id)["step"] == 12
        assert c.run_reward(TOY_REWARD, {"target": "aaaa"}, ["aaaa"])["results"][0]["reward"] == 1.0


def test_python_client_usage_matches_the_steps_run(embedded_service):
    """The embedded default (SQLite, filesystem broker) accounts usage too: the tenant's jobs' steps."""
    import time

    from gspo_client import Client

    url, key, *_ = embedded_service
    with Client(url, key) as c:
        for _ in range(120):  # other tests of this module may have left a job stopping
            runs = c.list_jobs(limit=200)["data"]
            if all(j["status"] in ("succeeded", "failed", "cancelled") for j in runs):
                break
            time.sleep(0.5)
        usage = c.usage()
        steps = [m["metrics"] for j in runs for m in c.metrics(j["id"])]
    ran = [j for j in runs if j["usage"]["device_seconds"] > 0]
    assert usage["total"]["jobs"] == len(ran) >= 2 and usage["budget_device_hours"] is None
    assert usage["total"]["tokens_sampled"] == sum(int(m["tokens/sampled"]) for m in steps) > 0
    assert usage["total"]["tokens_trained"] == sum(j["usage"]["tokens_trained"] for j in runs)
    assert usage["total"]["device_seconds"] == pytest.approx(sum(j["usage"]["device_seconds"] for j in runs))


def test_jobs_create_on_an_environment(embedded_service):
    """`gspo jobs create --environment`: no training file, the environment's own scoring; a bad task is the
    API's 422 naming the field."""
    from tests.api.test_environments import ENV

    created = gspo(embedded_service, "jobs", "create", "--model", "toy", "--environment", json.dumps(ENV))
    assert created.returncode == 0, created.stderr
    job = json.loads(created.stdout)
    assert job["environment"] == ENV and job["reward"]["type"] == "reasoning_gym" and job["training_file"] is None
    cancel = gspo(embedded_service, "jobs", "cancel", job["id"])
    assert cancel.returncode == 0 and cancel.stdout.strip() in ("cancelled", "cancelling")
    bad = {**ENV, "tasks": [{"name": "chain_sums"}]}
    r = gspo(embedded_service, "jobs", "create", "--model", "toy", "--environment", json.dumps(bad))
    assert r.returncode == 1 and "environment.tasks[0].name" in r.stderr and "chain_sum," in r.stderr, r.stderr

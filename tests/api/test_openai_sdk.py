"""The unmodified official `openai` SDK against a real `gspo api` (uvicorn) process and a real worker: files,
reinforcement jobs, events, checkpoints, graders and errors in OpenAI's shapes over the same jobs."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
import uuid

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM

from gspo_core.toy import write_toy_dataset
from tests.worker.conftest import ROOT, wait_for

PY_GRADER = {
    "type": "python",
    "name": "starts",
    "source": "def grade(sample, item):\n    return 1.0 if sample['output_text'].startswith(item['answer']) else 0.0\n",
}


def sdk(service, tenant: int = 0, key: str | None = None) -> openai.OpenAI:
    url, keys, _ = service
    return openai.OpenAI(base_url=url + "/v1", api_key=key or keys[tenant], max_retries=0)


def upload(client: openai.OpenAI, tmp) -> str:
    path = write_toy_dataset(tmp / "toy.jsonl", n=16)
    with open(path, "rb") as fh:
        f = client.files.create(file=fh, purpose="fine-tune")
    assert f.object == "file" and f.purpose == "fine-tune" and f.status == "processed"
    assert isinstance(f.created_at, int) and f.bytes == path.stat().st_size
    return f.id


SFT_HP = "method.supervised.hyperparameters.eval_interval"  # a reinforcement key: unknown for supervised


def upload_chat(client: openai.OpenAI, tmp, rows: list[dict]) -> str:
    path = tmp / f"chat-{uuid.uuid4().hex[:6]}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with open(path, "rb") as fh:
        return client.files.create(file=fh, purpose="fine-tune").id


def chat_rows(letters: str) -> list[dict]:
    """The toy task as chat rows; every other row has a second assistant turn left out of the loss (weight 0)."""
    rows = []
    for i, c in enumerate(letters):
        messages = [{"role": "user", "content": f"say {c}:"}, {"role": "assistant", "content": c * 4}]
        if i % 2:
            messages += [{"role": "user", "content": "again"}, {"role": "assistant", "content": "zq", "weight": 0}]
        rows.append({"messages": messages})
    return rows


def wait_done(client: openai.OpenAI, job_id: str, tmp, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, (tmp / "worker.log").read_text()[-3000:]
        time.sleep(0.5)
    assert job.status == "succeeded", (job, (tmp / "worker.log").read_text()[-3000:])
    return job


AGENT_TOOL = {"name": "lookup", "server_url": "http://tools.invalid/lookup", "headers": {"Authorization": "Bearer t"}}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
}


def rl_method(**hp) -> dict:
    return {
        "type": "reinforcement",
        "reinforcement": {
            "grader": PY_GRADER,
            "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "max_new_tokens": 4, **hp},
        },
    }


def test_files(service):
    client = sdk(service)
    file_id = upload(client, service[2])
    assert client.files.retrieve(file_id).filename == "toy.jsonl"
    assert b'"prompt"' in client.files.content(file_id).read()
    assert file_id in [f.id for f in client.files.list()]
    other = upload(client, service[2])
    assert [f.id for f in client.files.list(limit=1)][:2] == [other, file_id]  # auto-paging with `after`
    client.files.delete(other)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(other)
    with pytest.raises(openai.NotFoundError):
        sdk(service, 1).files.retrieve(file_id)
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.files.create(file=("x.jsonl", b'{"prompt": "a"}\n'), purpose="batch")
    assert exc.value.param == "purpose"


def test_reinforcement_job_runs_to_succeeded(service):
    url, keys, tmp = service
    client = sdk(service)
    file_id = upload(client, tmp)
    method = rl_method(n_epochs="auto", steps=2, save_every=1)
    method["reinforcement"]["response_format"] = RESPONSE_FORMAT
    job = client.fine_tuning.jobs.create(
        model="toy",
        training_file=file_id,
        method=method,
        suffix="sdk",
        seed=7,
        metadata={"suite": "openai"},
    )
    assert job.object == "fine_tuning.job" and job.status == "queued" and job.seed == 7 and job.suffix == "sdk"
    assert job.to_dict()["method"]["reinforcement"]["response_format"] == RESPONSE_FORMAT
    hp = job.method.reinforcement.hyperparameters
    assert (hp.batch_size, hp.compute_multiplier, hp.learning_rate_multiplier) == (2, 0.5, 1.0)
    assert hp.n_epochs == 1  # "auto" shown as the value used: 2 steps x 2 prompts begin 1 pass over 16 rows
    deadline = time.monotonic() + 300
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, (tmp / "worker.log").read_text()[-3000:]
        time.sleep(1)
    assert job.status == "succeeded", (job, (tmp / "worker.log").read_text()[-3000:])
    assert job.finished_at >= job.created_at and job.trained_tokens > 0
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    assert events == list(client.fine_tuning.jobs.list_events(job.id, limit=3))  # cursor pages, newest first
    metrics = [e for e in events if e.type == "metrics"]
    assert [e.data["step"] for e in metrics] == [2, 1]
    data = metrics[0].data
    assert data["total_steps"] == 2 and 0.0 <= data["train_mean_reward"] <= 1.0
    assert set(data["scores"]) == {"starts"} and data["errors"] == {"starts": 0.0} and "step" in data["timing"]
    assert events[0].type == "message" and events[0].message == "The job has successfully completed"
    ckpts = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in ckpts] == [2, 1] and ckpts[0].object == "fine_tuning.job.checkpoint"
    assert job.fine_tuned_model == ckpts[0].fine_tuned_model_checkpoint == f"ckpt:{ckpts[0].id}"
    assert ckpts[0].metrics.to_dict()["train_mean_reward"] == data["train_mean_reward"]
    # The checkpoint's download (its download_url, the same API key) loads in transformers as it is.
    archive = httpx.get(ckpts[0].to_dict()["download_url"], headers={"Authorization": f"Bearer {keys[0]}"})
    assert archive.status_code == 200, archive.text
    with tarfile.open(fileobj=io.BytesIO(archive.content), mode="r:gz") as tar:
        tar.extractall(tmp / "download", filter="data")
    (model_dir,) = (tmp / "download").glob("*/model")
    assert AutoModelForCausalLM.from_pretrained(model_dir).num_parameters() > 0
    native = httpx.get(f"{url}/v1/jobs/{job.id}", headers={"Authorization": f"Bearer {keys[0]}"}).json()
    assert native["status"] == "succeeded" and native["hyperparameters"]["group_size"] == 4
    assert native["name"] == "sdk" and native["metadata"] == {"suite": "openai"}


def test_list_pagination_metadata_and_cancel(service):
    url, keys, tmp = service
    client = sdk(service, 2)
    file_id = upload(client, tmp)
    made = [
        client.fine_tuning.jobs.create(
            model="toy", training_file=file_id, method=rl_method(steps=500), metadata={"batch": "b", "i": str(i)}
        ).id
        for i in range(2)
    ]
    native = httpx.post(  # the native API's job shows in OpenAI's list too
        f"{url}/v1/jobs",
        headers={"Authorization": f"Bearer {keys[2]}"},
        json={"model": "toy", "training_file": file_id, "reward": PY_GRADER, "hyperparameters": {"steps": 500}},
    ).json()["id"]
    with pytest.raises(openai.RateLimitError):  # GSPO_MAX_ACTIVE_JOBS_PER_TENANT=3
        client.fine_tuning.jobs.create(model="toy", training_file=file_id, method=rl_method(steps=1))
    page = client.fine_tuning.jobs.list(limit=2)
    assert [j.id for j in page.data] == [native, made[1]] and page.has_more
    assert [j.id for j in client.fine_tuning.jobs.list(limit=1)] == [native, *reversed(made)]
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"batch": "b"})] == list(reversed(made))
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"i": "0"})] == [made[0]]
    for job_id in [*made, native]:
        cancelled = client.fine_tuning.jobs.cancel(job_id)
        assert cancelled.status == "cancelled" and cancelled.gspo_status in ("cancelled", "cancelling")
    with pytest.raises(openai.BadRequestError) as exc:  # a cancelled job neither pauses nor resumes
        client.fine_tuning.jobs.pause(made[0])
    assert "cannot be paused" in exc.value.message
    with pytest.raises(openai.BadRequestError):
        client.fine_tuning.jobs.resume(made[0])
    # Agent RFT's tools become native http tools; the job shows them back, credentials redacted.
    agent = rl_method(steps=500, max_episode_steps=3)
    agent["reinforcement"]["tools"] = [AGENT_TOOL]
    agent_job = client.fine_tuning.jobs.create(model="toy", training_file=file_id, method=agent).id
    shown = client.fine_tuning.jobs.retrieve(agent_job).to_dict()["method"]["reinforcement"]
    assert shown["tools"] == [{**AGENT_TOOL, "headers": {"Authorization": "[redacted]"}}]
    assert shown["hyperparameters"]["max_episode_steps"] == 3
    native_view = httpx.get(f"{url}/v1/jobs/{agent_job}", headers={"Authorization": f"Bearer {keys[2]}"}).json()
    assert native_view["tools"][0]["type"] == "http" and native_view["hyperparameters"]["max_turns"] == 3
    client.fine_tuning.jobs.cancel(agent_job)


def test_graders_run_agrees_with_rewards_run(service):
    url, keys, _ = service
    client = sdk(service)
    grader = {
        "type": "multi",
        "name": "both",
        "graders": {
            "exact": {
                "type": "string_check",
                "name": "exact",
                "input": "{{sample.output_text}}",
                "reference": "{{item.target}}",
                "operation": "eq",
            },
            "py": PY_GRADER,
        },
        "calculate_output": "0.5 * exact + 0.5 * py",
    }
    item = {"answer": "a", "target": "aaab"}
    for sample in ("aaab", "abcd", "zzzz"):
        ours = httpx.post(
            f"{url}/v1/rewards/run",
            headers={"Authorization": f"Bearer {keys[0]}"},
            json={"reward": grader, "item": item, "samples": [sample]},
        ).json()["results"][0]
        run = client.fine_tuning.alpha.graders.run(grader=grader, model_sample=sample, item=item)
        assert run.reward == ours["reward"] and run.sub_rewards == ours["scores"]
        assert run.metadata.type == "multi" and not run.metadata.errors.python_grader_runtime_error
    broken = {**PY_GRADER, "source": "def grade(sample, item):\n    return 1 / 0\n"}
    run = client.fine_tuning.alpha.graders.run(grader=broken, model_sample="a", item=item)
    assert run.reward == 0.0 and run.metadata.errors.python_grader_runtime_error
    assert "ZeroDivisionError" in run.metadata.errors.python_grader_runtime_error_details
    assert client.fine_tuning.alpha.graders.validate(grader=grader).grader.type == "multi"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"method": {"type": "supervised", "supervised": {}}}, "training_file.messages"),  # prompt rows
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"eval_interval": 2}}}}, SFT_HP),
        ({"method": {"type": "dpo", "dpo": {}}}, "method.type"),
        ({"method": rl_method(batch_size=-1)}, "method.reinforcement.hyperparameters.batch_size"),
        (
            {"method": rl_method(compute_multiplier="auto", group_size=1)},
            "method.reinforcement.hyperparameters.group_size",
        ),
        ({"method": rl_method(reasoning_effort="high")}, "method.reinforcement.hyperparameters.reasoning_effort"),
        ({"method": rl_method(n_epochs=2, steps=3)}, "method.reinforcement.hyperparameters.n_epochs"),
        ({"model": "no-such-model"}, "model"),
        (
            {"method": {**rl_method(), "reinforcement": {**rl_method()["reinforcement"], "tools": [{"name": "f"}]}}},
            "method.reinforcement.tools[0].server_url",
        ),
        (
            {"method": {**rl_method(), "reinforcement": {**rl_method()["reinforcement"], "response_format": {"x": 1}}}},
            "method.reinforcement.response_format",
        ),
    ],
)
def test_bad_requests_name_the_param(service, change, param):
    client = sdk(service)
    body = {"model": "toy", "training_file": upload(client, service[2]), "method": rl_method(steps=1), **change}
    with pytest.raises(openai.BadRequestError) as exc:
        client.fine_tuning.jobs.create(**body)
    assert exc.value.param == param, exc.value.body


def test_error_classes(service):
    client = sdk(service)
    file_id = upload(client, service[2])
    bad_grader = {**PY_GRADER, "source": "def grade(sample, item) return 1"}
    with pytest.raises(openai.BadRequestError) as exc:
        method = {"type": "reinforcement", "reinforcement": {"grader": bad_grader}}
        client.fine_tuning.jobs.create(model="toy", training_file=file_id, method=method)
    assert exc.value.param == "method.reinforcement.grader.source"
    with pytest.raises(openai.BadRequestError) as exc:
        client.fine_tuning.alpha.graders.run(grader={**PY_GRADER, "type": "string_check"}, model_sample="a")
    assert exc.value.param.startswith("grader.")
    with pytest.raises(openai.NotFoundError) as exc:
        client.fine_tuning.jobs.create(model="toy", training_file="file_missing", method=rl_method(steps=1))
    assert exc.value.param == "training_file"
    with pytest.raises(openai.AuthenticationError) as exc:
        sdk(service, key="wrong").fine_tuning.jobs.list()
    assert exc.value.type == "authentication_error"
    job = client.fine_tuning.jobs.create(model="toy", training_file=file_id, method=rl_method(steps=1))
    other = sdk(service, 1)
    for call in (
        other.fine_tuning.jobs.retrieve,
        other.fine_tuning.jobs.cancel,
        other.fine_tuning.jobs.list_events,
        other.fine_tuning.jobs.checkpoints.list,
    ):
        with pytest.raises(openai.NotFoundError):
            call(job.id)
    with pytest.raises(openai.NotFoundError):
        other.fine_tuning.jobs.create(model="toy", training_file=file_id, method=rl_method(steps=1))
    client.fine_tuning.jobs.cancel(job.id)


def test_the_readmes_openai_script_runs_unchanged(service):
    """README's "Coming from OpenAI" script, as written there, against the service (the SDK's own env vars)."""
    url, keys, tmp = service
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Coming from OpenAI") :]
    script = section[section.index("```python\n") + 10 : section.index("```\n", section.index("```python"))]
    (tmp / "rft.py").write_text(script)
    dataset = write_toy_dataset(tmp / "readme.jsonl", n=16)
    env = {**os.environ, "OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": keys[1]}
    done = subprocess.run(
        [sys.executable, str(tmp / "rft.py"), "toy", str(dataset)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("succeeded ckpt:"), done.stdout
    assert "metrics" in {line.split()[0] for line in lines[:-1]}, done.stdout


def test_supervised_job_then_reinforcement_from_its_checkpoint(service):
    """SFT-then-RL: a supervised job lowers its loss, keeps its newest checkpoint and its 2 best by validation
    loss (8 saved), and a reinforcement job starts from its fine_tuned_model."""
    url, keys, tmp = service
    client = sdk(service)
    bad = chat_rows("ab")
    bad[1]["messages"][3]["weight"] = 2
    with pytest.raises(openai.BadRequestError) as exc:
        client.fine_tuning.jobs.create(
            model="toy", training_file=upload_chat(client, tmp, bad), method={"type": "supervised"}
        )
    assert exc.value.param == "training_file.messages[3].weight" and "line 2" in exc.value.message
    train, valid = upload_chat(client, tmp, chat_rows("abcdeabc")), upload_chat(client, tmp, chat_rows("abcde"))
    hp = {"batch_size": 4, "n_epochs": 4, "learning_rate_multiplier": 500}
    job = client.fine_tuning.jobs.create(
        model="toy",
        training_file=train,
        validation_file=valid,
        method={
            "type": "supervised",
            "supervised": {"hyperparameters": {**hp, "save_every": 1, "keep_best_checkpoints": 2}},
        },
    )
    assert job.method.type == "supervised" and job.method.supervised.hyperparameters.to_dict() == hp
    # eval_interval "auto" with a validation file: a tenth of the steps, at least 1
    assert job.gspo_hyperparameters["steps"] == 8 and job.gspo_hyperparameters["eval_every"] == 1
    job = wait_done(client, job.id, tmp)
    metrics = {
        e.data["step"]: e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"
    }
    assert sorted(metrics) == list(range(0, 9)), "step 0: the held-out evaluation before training"
    assert metrics[8]["full_valid_loss"] < metrics[0]["full_valid_loss"]
    assert metrics[8]["train_loss"] < 0.7 * metrics[1]["train_loss"], metrics
    assert metrics[8]["full_valid_loss"] < metrics[1]["full_valid_loss"]
    best = sorted(range(1, 8), key=lambda step: (metrics[step]["full_valid_loss"], -step))[:2]
    kept = sorted({8, *best}, reverse=True)
    ckpts = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in ckpts] == kept
    assert ckpts[0].metrics.to_dict()["train_loss"] == metrics[8]["train_loss"]
    native = httpx.get(f"{url}/v1/jobs/{job.id}/checkpoints", headers={"Authorization": f"Bearer {keys[0]}"})
    assert sorted(c["step"] for c in native.json()["data"]) == sorted(kept)
    stored = {p.name.split("-a")[0] for p in (tmp / "objects" / "jobs" / job.id / "checkpoints").iterdir()}
    assert stored == {f"step-{step:06d}" for step in kept}  # the others' objects are deleted
    rl = client.fine_tuning.jobs.create(
        model=job.fine_tuned_model, training_file=upload(client, tmp), method=rl_method(steps=1)
    )
    assert rl.model == job.fine_tuned_model == f"ckpt:{ckpts[0].id}"
    assert wait_done(client, rl.id, tmp).fine_tuned_model is not None


@pytest.mark.vllm
@pytest.mark.slow
def test_gspo_serve_answers_chat_completions(service):
    """`gspo serve <fine_tuned_model>` downloads the checkpoint over the API and runs vLLM's OpenAI-compatible server
    on it: the SDK's chat.completions answers under that name. Without a key it copies it from the local store."""
    url, keys, tmp = service
    client = sdk(service)
    method = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}}
    job = client.fine_tuning.jobs.create(
        model="toy", training_file=upload_chat(client, tmp, chat_rows("ab")), method=method
    )
    name = wait_done(client, job.id, tmp).fine_tuned_model
    cli = [sys.executable, "-m", "gspo_cli.main", "serve", name]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GSPO_DATA_DIR": str(tmp)}
    local = subprocess.run(
        [*cli, "--cache-dir", str(tmp / "local"), "--fetch-only"], env=env, capture_output=True, text=True
    )
    assert local.returncode == 0, local.stderr
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env |= {"GSPO_API_KEY": keys[0], "GSPO_BASE_URL": url, "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = ["--cache-dir", str(tmp / "api"), "--port", str(port), "--vllm-args=--max-model-len 128"]
    with (
        open(tmp / "serve.log", "w") as log,
        subprocess.Popen([*cli, *args], env=env, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        try:
            wait_for(lambda: _healthy(f"http://127.0.0.1:{port}/health"), 180, "vLLM's server up")
            served = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            answer = served.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "say a:"}], max_tokens=4, temperature=0
            )
        finally:
            proc.terminate()
            proc.wait(60)
    assert answer.model == name and answer.choices[0].message.content is not None, (tmp / "serve.log").read_text()
    ckpt = name.removeprefix("ckpt:")
    assert (tmp / "api" / ckpt / "config.json").read_bytes() == (tmp / "local" / ckpt / "config.json").read_bytes()
    assert {p.name for p in (tmp / "api" / ckpt).iterdir()} == {p.name for p in (tmp / "local" / ckpt).iterdir()}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False

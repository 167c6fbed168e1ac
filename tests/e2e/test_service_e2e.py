"""End to end over real servers: uvicorn API + Celery worker (vLLM engine) over Redis and PostgreSQL."""

from __future__ import annotations

import socket
import sys
import tarfile
import time

import httpx
import pytest

from gspo_client import ApiError, Client
from gspo_core.toy import TOY_REWARD, write_toy_dataset
from tests.conftest import redis_url as suite_redis_url
from tests.conftest import spawn_logged
from tests.worker.conftest import ROOT, build_rig, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def service(pg_database, tmp_path):
    from tests.conftest import truncate_all

    truncate_all(pg_database)
    redis_url = suite_redis_url("e2e")
    rig = build_rig(tmp_path, pg_database, redis_url, GSPO_ROLLOUT_ENGINE="vllm")
    port = free_port()
    api = spawn_logged(
        [sys.executable, "-m", "gspo_cli.main", "api", "--host", "127.0.0.1", "--port", str(port)],
        tmp_path / "api.log",
        env=rig.env,
        cwd=ROOT,
    )
    rig.start_worker()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _up(url), 60, "API up")
    key = rig.h["Authorization"].split()[1]
    yield url, key, rig
    api.terminate()
    api.wait(10)
    rig.stop_all()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
@pytest.mark.vllm
def test_upload_train_follow_download_load(service, tmp_path):
    url, key, rig = service
    with Client(url, key) as client:
        with pytest.raises(ApiError) as exc:
            client.upload_file(tmp_path.joinpath("bad.jsonl").write_bytes(b"[1]\n") and tmp_path / "bad.jsonl")
        assert exc.value.status == 400 and exc.value.line == 1
        f = client.upload_file(write_toy_dataset(tmp_path / "toy.jsonl", n=64))
        job = client.create_job(
            model="toy",
            training_file=f["id"],
            reward=TOY_REWARD,
            name="e2e",
            hyperparameters={
                "steps": 70,
                "prompts_per_step": 8,
                "group_size": 8,
                "max_new_tokens": 4,
                "learning_rate": 2e-3,
                "save_every": 35,
            },
        )
        kinds, steps = [], []
        t0 = time.monotonic()
        for event, data, _ in client.events(job["id"]):
            kinds.append(event)
            if event == "metrics":
                steps.append((data["step"], data["metrics"]["reward/mean"]))
            assert time.monotonic() - t0 < 400
        assert kinds[-1] == "end", kinds
        job = client.get_job(job["id"])
        assert job["status"] == "succeeded", (job, rig.logs())
        assert [s for s, _ in steps] == list(range(1, 71))
        first = sum(r for _, r in steps[:5]) / 5
        last = sum(r for _, r in steps[-5:]) / 5
        print(f"e2e reward {first:.3f} -> {last:.3f}")
        # Seeds 0-9 in-process, same settings: last 5 steps at 0.39-0.94 over two versions of the code
        # with vLLM's Gumbel sampler, 0.49-0.95 with the inverse-CDF one (lr 3e-3: 0.29-0.99, some
        # seeds collapse onto "eeee" for two of the five letters).
        # This checks that the service trains, with margin; how fast against TRL is in bench/.
        assert first < 0.1 and last > 0.3
        metrics = client.metrics(job["id"])
        assert metrics[-1]["metrics"]["logprob_gap/max"] < 1e-3
        ckpts = client.list_checkpoints(job["id"])
        assert [c["step"] for c in ckpts] == [35, 70]
        archive = client.download_checkpoint(ckpts[-1]["id"], tmp_path / "ckpt.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = next((tmp_path / "x").glob("*/model"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok("say b:", return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4

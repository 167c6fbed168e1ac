"""A GSPO job on a real pretrained model (SmolLM2-135M-Instruct: 49k vocabulary, ChatML template, tied
embeddings) through the service over HTTP: chat rows, vLLM rollouts, a checkpoint that loads back."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.embedded_service import ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REWARD = {"type": "math_answer", "name": "correct", "reference": "{{item.answer}}"}


def _rows() -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}], "answer": str(a + b)}
        for a, b in [(17, 25), (3, 4), (12, 30), (8, 9), (21, 21), (5, 60)]
    ]


def test_a_gspo_job_on_smollm2_completes_over_http(smollm2_dir, tmp_path):
    pytest.importorskip("vllm")
    from api.app import create_app
    from gspo_client import Client
    from store.db import run_migrations
    from store.settings import Settings
    from store.tenants import create_tenant_and_key
    from tests.api.live import LiveServer
    from tests.conftest import spawn_logged

    models = smollm2_dir.parent  # the cache: a model's directory may not lead outside the models directory
    env = {
        **os.environ,
        "GSPO_DATA_DIR": str(tmp_path),
        "GSPO_MODELS_DIR": str(models),
        "GSPO_ROLLOUT_ENGINE": "vllm",
        "PYTHONPATH": str(ROOT),
    }
    settings = Settings(data_dir=tmp_path, models_dir=models)
    run_migrations(settings.resolved_database_url())
    worker = spawn_logged(
        [sys.executable, "-m", "gspo_cli.main", "worker", "--loglevel", "WARNING"],
        tmp_path / "worker.log",
        env=env,
        cwd=ROOT,
    )
    app = create_app(settings)
    try:
        with app.state.db.session() as s:
            _, key = create_tenant_and_key(s, "real")
        data = tmp_path / "sums.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
        with LiveServer(app) as live, Client(live.url, key) as c:
            job = c.create_job(
                model=smollm2_dir.name,
                training_file=c.upload_file(data)["id"],
                reward=REWARD,
                hyperparameters={"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12},
            )
            for _ in c.events(job["id"]):
                pass
            done = c.get_job(job["id"])
            log = (tmp_path / "worker.log").read_text()[-3000:]
            assert done["status"] == "succeeded", (done, log)
            metrics = c.metrics(job["id"])
            assert [m["step"] for m in metrics] == [1, 2]
            first = metrics[0]["metrics"]
            # the sampler (vLLM) and the trainer agree on the real model's log-probs: same weights, same vocabulary
            assert first["logprob_gap/mean"] < 1e-3, first
            # completions end at the chat template's end of turn, not at max_new_tokens every time
            assert first["completion/len_mean"] <= 12
            assert c.list_checkpoints(job["id"]), "the final checkpoint"
    finally:
        worker.terminate()
        worker.wait(30)
        app.state.db.dispose()

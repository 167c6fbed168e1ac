"""A GSPO job on a real pretrained model (SmolLM2-135M-Instruct: 49k vocabulary, ChatML template, tied
embeddings) through the service over HTTP: chat rows, vLLM rollouts and weight pushes, a checkpoint."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.embedded_service import ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Graded (not 0/1), so groups do not tie and step 1 changes the weights: step 2 then samples from pushed weights.
REWARD = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "The answer is {{item.answer}}.",
    "evaluation_metric": "fuzzy_match",
}


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
            assert done["status"] == "succeeded", (done["error"], log)
            metrics = c.metrics(job["id"])
            assert [m["step"] for m in metrics] == [1, 2]
            first, second = metrics[0]["metrics"], metrics[1]["metrics"]
            assert first["reward/frac_zero_std"] < 1, first  # an update that moves the weights
            # the sampler (vLLM) and the trainer agree on the real model's log-probs, before and after a push of
            # its tied embeddings (a stale LM head in vLLM would be off by the update, >> 1e-4)
            assert first["logprob_gap/mean"] < 1e-4 and second["logprob_gap/mean"] < 1e-4, (first, second)
            # completions end at the chat template's end of turn (the imported EOS), not all at max_new_tokens
            assert first["completion/truncated_frac"] < 1, first
            assert c.list_checkpoints(job["id"]), "the final checkpoint"
    finally:
        worker.terminate()
        worker.wait(30)
        app.state.db.dispose()

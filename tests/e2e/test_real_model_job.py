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


def _rows(pairs: list[tuple[int, int]]) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}], "answer": str(a + b)}
        for a, b in pairs
    ]


def _write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


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
        data = _write(tmp_path / "sums.jsonl", _rows([(17, 25), (3, 4), (12, 30), (8, 9)]))
        held_out = _write(tmp_path / "held-out.jsonl", _rows([(21, 21), (5, 60)]))
        with LiveServer(app) as live, Client(live.url, key) as c:
            job = c.create_job(
                model=smollm2_dir.name,
                training_file=c.upload_file(data)["id"],
                validation_file=c.upload_file(held_out)["id"],
                reward=REWARD,
                # The fewest rows that still test the path (the step's cost is the 49k-vocabulary forward and
                # backward over them): 2 steps, the second sampling from the weights the first pushed; 2 prompts x
                # 2 samples in one update; 2 held-out prompts evaluated before the first step and after the last.
                hyperparameters={
                    "steps": 2,
                    "prompts_per_step": 2,
                    "group_size": 2,
                    "mini_batches": 1,
                    "max_new_tokens": 16,
                    "eval_prompts": 2,
                    # one mini-batch needs no sampler log-probs: ask for them on both steps, for the gap check
                    "logprob_gap_every": 1,
                },
            )
            for _ in c.events(job["id"]):
                pass
            done = c.get_job(job["id"])
            log = (tmp_path / "worker.log").read_text()[-3000:]
            assert done["status"] == "succeeded", (done["error"], log)
            # the held-out evaluation before the first step and after the last (issue 37's before -> after)
            before, after = done["evaluation"]["before"], done["evaluation"]["after"]
            assert (before["step"], after["step"], before["prompts"], after["prompts"]) == (0, 2, 2, 2), done
            for point in (before, after):
                assert 0 <= point["greedy_reward"] <= 1 and 0 <= point["sampled_reward"] <= 1, point
            steps = {m["step"]: m["metrics"] for m in c.metrics(job["id"])}
            assert sorted(steps) == [0, 1, 2]
            assert steps[0]["eval/greedy/reward/mean"] == before["greedy_reward"]
            assert steps[2]["eval/greedy/reward/mean"] == after["greedy_reward"]
            first, second = steps[1], steps[2]
            assert first["reward/frac_zero_std"] < 1, first  # an update that moves the weights
            # the sampler (vLLM) and the trainer agree on the real model's log-probs, before and after a push of
            # its tied embeddings (a stale LM head in vLLM would be off by the update, >> 1e-4)
            assert first["logprob_gap/mean"] < 1e-4 and second["logprob_gap/mean"] < 1e-4, (first, second)
            # completions end at the chat template's end of turn (the imported EOS), not all at max_new_tokens
            # (of 2 x 4 completions: at 12 tokens about half of the model's answers were cut)
            assert min(first["completion/truncated_frac"], second["completion/truncated_frac"]) < 1, (first, second)
            assert c.list_checkpoints(job["id"]), "the final checkpoint"
    finally:
        worker.terminate()
        worker.wait(30)
        app.state.db.dispose()

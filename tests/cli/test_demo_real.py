"""`gspo demo --real` puts SmolLM2-135M-Instruct in the models directory with the install step's own code (the
demo's training run itself is the real-model bench's code path, covered by tests/bench/test_real_model_smoke.py)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_the_real_demo_places_the_imported_model_where_jobs_name_it(tmp_path, smollm2_dir):
    from gspo_cli.demo_real import MODEL, real_model
    from store.model_refs import resolve_model

    models = tmp_path / "models"
    assert real_model(models) == MODEL
    placed = models / MODEL
    assert resolve_model(models, MODEL) == str(placed.resolve())  # a model a job may name, not a link out of it
    assert json.loads((placed / "config.json").read_text()) == json.loads((smollm2_dir / "config.json").read_text())
    weights = placed / "model.safetensors"
    assert weights.stat().st_size == (smollm2_dir / "model.safetensors").stat().st_size
    if weights.stat().st_dev == (smollm2_dir / "model.safetensors").stat().st_dev:
        assert weights.stat().st_ino == (smollm2_dir / "model.safetensors").stat().st_ino  # linked, not copied
    weights.unlink()  # a second run finds it in place (config.json) and imports nothing
    assert real_model(models) == MODEL and not weights.exists()
    assert not list(models.glob(".*.partial"))


def test_the_real_demo_runs_the_benchmarks_task_prompt_and_reward():
    """The demo's job copies the bench's setup (an installed CLI has no bench/): the same task config, system
    prompt and reward, so the demo shows what docs/bench.md measured; it reports the task's score alone."""
    from bench.real_trainers import REWARD, SYSTEM_PROMPT, TASKS
    from gspo_cli import demo_real

    assert {"name": "basic_arithmetic", "config": TASKS["basic_arithmetic"]} == demo_real.TASK
    assert demo_real.SYSTEM_PROMPT == SYSTEM_PROMPT and demo_real.REWARD == REWARD
    points = [
        {"step": 0, "metrics": {"eval/reward/mean": 0.2, demo_real.ANSWER_METRIC: 0.05}},
        {"step": 1, "metrics": {"reward/mean": 0.4}},
        {"step": 2, "metrics": {"eval/reward/mean": 0.6, demo_real.ANSWER_METRIC: 0.375}},
    ]
    assert (demo_real._accuracy(points, 0), demo_real._accuracy(points, None)) == ("0.050", "0.375")
    assert demo_real._accuracy(points[1:2], 0) == "?"

"""The primitives-vs-job benchmark (issue 38) runs end to end at its tiniest size, so it cannot rot; timings are
not asserted, only that both paths ran the same work and reported."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_primitives_bench_runs_the_job_and_the_cookbook_loop(tmp_path):
    from bench.primitives import main

    args = ["--steps", "2", "--runs", "1", "--prompts", "2", "--group", "2", "--tokens", "4", "--updates", "2"]
    args += ["--engine", "transformers"]  # the bench's code is under test here, not vLLM's start-up
    assert main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    runs = {r["name"]: r for r in result["runs"]}
    assert set(runs) == {"job", "primitives"}
    for r in runs.values():
        assert len(r["step_s"]) == len(r["step_cpu_s"]) == len(r["reward"]) == 2
        assert all(s > 0 for s in r["step_s"]) and all(c > 0 for c in r["step_cpu_s"])
        assert all(0 <= x <= 1 for x in r["reward"])
        # fixed-length work on both paths: 2 prompts x 2 samples x 4 tokens each step
        assert r["tokens_sampled"] == [16.0, 16.0]
        assert {"rollout", "reward", "train", "weight_sync"} <= set(r["phases"])
    s = result["summary"]
    assert s["ratio_wall"] > 0 and s["ratio_cpu"] > 0 and len(s["ratio_wall_pairs"]) == 1
    assert result["load_at_start"]
    md = next(tmp_path.glob("*.md")).read_text()
    assert "| job | transformers |" in md and "| primitives | transformers |" in md and "primitives / job" in md

"""The benchmark runs end to end on the toy shape (so it cannot rot); timings are not asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl", reason="the bench extra (TRL) is installed by `make test`")


@pytest.mark.slow
@pytest.mark.vllm
def test_bench_toy_runs_both_trainers(tmp_path):
    from bench.run import main

    assert main(["--shape", "toy", "--steps", "2", "--runs", "1", "--tokens", "8", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    s = result["summary"]
    assert s["ours"]["step_s_median"] > 0 and s["trl"]["step_s_median"] > 0 and s["ratio_ours_over_trl"] > 0
    assert {"rollout", "reward", "old_logprobs", "train", "weight_sync"} <= set(s["ours"]["phases_s"])
    assert len(result["runs"][0]["reward"]) == 2 and len(result["runs"][1]["step_s"]) == 2
    assert next(tmp_path.glob("*.png")).stat().st_size > 1000

"""bench.fairness runs end to end (briefly) against a real `gspo api` on PostgreSQL; timings are not
asserted, only that both phases measured the victim and the hostile tenant met its caps."""

from __future__ import annotations

import json

from tests.conftest import redis_url


def test_fairness_bench_smoke(tmp_path):
    from bench.fairness import main

    out = tmp_path / "fairness.json"
    code = main(
        [
            "--seconds",
            "3",
            "--victims",
            "4",
            "--upload-mb",
            "2",
            "--api-workers",
            "1",
            "--redis-url",
            redis_url("api"),
            "--run-samples",
            "2",
            "--json",
            str(out),
        ]
    )
    baseline, hostile = json.loads(out.read_text())
    assert code == 0  # no victim request failed
    for report in (baseline, hostile):
        assert all(report["victim"][k]["n"] > 0 for k in ("status", "metrics", "healthz"))
    seen = hostile["hostile_requests"]
    assert seen.get("stream 200", 0) >= 1 and seen.get("stream 429", 0) > 0  # the cap was kept full
    assert seen.get("reward_run 429", 0) > 0 and seen.get("upload 201", 0) > 0

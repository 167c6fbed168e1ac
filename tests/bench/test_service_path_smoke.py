"""The service-path benchmark runs end to end on the toy model (so it cannot rot): the same job in-process and
through the embedded service over HTTP does the same work (the same tokens trained, the same rewards), and the
report holds both paths' phases and the service's overheads. No timing is asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym environments")


@pytest.mark.slow
def test_service_path_bench_runs_the_same_job_in_process_and_over_http(tmp_path, tiny_model_dir):
    from bench.service_path import main

    args = ["--model", str(tiny_model_dir), "--task", "chain_sum", "--steps", "2", "--prompts", "2", "--group", "2"]
    args += ["--tokens", "4", "--updates", "2", "--engine", "transformers", "--out", str(tmp_path)]
    assert main(args) == 0
    runs = {r["path"]: r for r in json.loads(next(tmp_path.glob("*.json")).read_text())["runs"]}
    assert set(runs) == {"inproc", "service"}
    inproc, service = runs["inproc"]["metrics"], runs["service"]["metrics"]
    assert len(inproc) == len(service) == 2
    for a, b in zip(inproc, service, strict=True):
        assert a["tokens/trained"] == b["tokens/trained"] and a["reward/mean"] == pytest.approx(b["reward/mean"])
    s = runs["service"]
    assert s["queue_wait_s"] >= 0 and s["checkpoint_at"] >= s["reported_at"][-1] > s["reported_at"][0] > 0
    md = next(tmp_path.glob("*.md")).read_text()
    assert "| inproc mbt 512 | 2 |" in md and "| service mbt 512 | 2 |" in md

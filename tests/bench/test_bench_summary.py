"""The benchmark's summary: warm-up step dropped, alternating runs paired, phases and push share."""

from __future__ import annotations

import pytest

from bench.run import markdown, summarize
from bench.workload import Workload


def _run(name: str, steps: list[float], push: float = 0.0) -> dict:
    phases = {"rollout": [s / 2 for s in steps], "weight_sync": [push] * len(steps)}
    return {
        "trainer": "trl" if name.startswith("trl") else "ours",
        "name": name,
        "engine": "transformers",
        "step_s": steps,
        "phases": phases,
        "reward": [0.1, 0.2, 0.3],
        "peak_rss_mb": 100.0,
    }


def test_summary_pairs_alternating_runs_and_drops_warmup():
    runs = [
        _run("ours", [9.0, 1.0, 1.0], push=0.04),
        _run("trl", [9.0, 4.0, 4.0]),
        _run("ours", [9.0, 3.0, 3.0], push=0.04),
        _run("trl", [9.0, 4.0, 4.0]),
    ]
    s = summarize(runs)
    assert s["ratio_per_run_pair"] == pytest.approx([0.25, 0.75])
    assert s["ratio_ours_over_trl"] == pytest.approx(0.5)
    assert s["ours"]["step_s_median"] == pytest.approx(2.0)  # median of steps 2..N of both runs
    assert s["ours"]["phases_s"]["rollout"] == pytest.approx(1.0)
    assert s["ours"]["weight_push_frac_of_step"] == pytest.approx(0.02)
    assert s["trl"]["reward_curve"] == pytest.approx([0.1, 0.2, 0.3])
    md = markdown(Workload(), s)
    assert "0.500" in md and "| trl |" in md and "2.0 %" in md


def test_a_summary_written_mid_way_pairs_only_the_runs_both_trainers_finished():
    # bench.run writes the summary after every run: after ours, trl, ours the second ours has no peer yet.
    runs = [_run("ours", [9.0, 1.0]), _run("trl", [9.0, 4.0]), _run("ours", [9.0, 3.0])]
    assert summarize(runs)["ratio_per_run_pair"] == pytest.approx([0.25])


def test_summary_of_one_trainer_has_no_ratio():
    s = summarize([_run("ours", [2.0, 1.0])])
    assert "ratio_ours_over_trl" not in s and s["ours"]["step_s_median"] == 1.0


def test_summary_also_pairs_ours_with_trl_under_our_heap_policy():
    runs = [
        _run("ours", [9.0, 2.0]),
        _run("trl", [9.0, 4.0]),
        _run("trl-keepmem", [9.0, 2.5]),
        _run("ours", [9.0, 3.0]),
        _run("trl", [9.0, 5.0]),
        _run("trl-keepmem", [9.0, 5.0]),
    ]
    s = summarize(runs)
    assert s["ratio_per_run_pair"] == pytest.approx([0.5, 0.6])
    assert s["ratio_per_run_pair_keepmem"] == pytest.approx([0.8, 0.6])
    assert s["ratio_ours_over_trl_keepmem"] == pytest.approx(0.7)
    assert "Ours / TRL with our heap policy: 0.700" in markdown(Workload(), s)


def test_summary_pairs_the_bf16_variants_with_each_other():
    runs = [
        _run("ours", [9.0, 2.0]),
        _run("ours-bf16", [9.0, 1.0]),
        _run("trl-bf16", [9.0, 4.0]),
        _run("ours", [9.0, 2.0]),
        _run("ours-bf16", [9.0, 1.5]),
        _run("trl-bf16", [9.0, 5.0]),
    ]
    s = summarize(runs)
    assert "ratio_ours_over_trl" not in s  # no fp32 TRL ran
    assert s["ratio_per_run_pair_bf16"] == pytest.approx([0.25, 0.3])
    assert "Both in bf16 (ours-bf16 / trl-bf16): 0.275" in markdown(Workload(), s)

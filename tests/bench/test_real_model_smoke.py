"""The real-model learning benchmark runs end to end on the toy model (so it cannot rot); nothing is asserted
of learning or timings, only that every trainer ran, was evaluated on the same held-out items, and reported."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl", reason="the bench extra (TRL) is installed by `make test`")
pytest.importorskip("reasoning_gym", reason="reasoning-gym environments")


@pytest.mark.slow
def test_real_model_bench_runs_ours_gspo_grpo_and_trl(tmp_path, tiny_model_dir):
    from bench.real_model import main

    args = ["--model", str(tiny_model_dir), "--tasks", "chain_sum", "--seeds", "0", "--steps", "2"]
    args += ["--prompts", "2", "--group", "2", "--tokens", "4", "--updates", "2", "--eval-prompts", "3"]
    args += ["--engine", "transformers"]  # the bench's code is under test here, not vLLM's start-up
    assert main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    runs = {r["trainer"]: r for r in result["runs"]}
    assert set(runs) == {"ours-gspo", "ours-grpo", "trl"}
    for r in runs.values():
        assert r["steps_done"] == 2 and len(r["reward"]) == 2 and len(r["step_s"]) == 2
        assert len(r["clip_frac"]) == 2 and r["peak_rss_mb"] > 0
        assert r["eval"]["items"] == 3 and 0 <= r["eval"]["accuracy"] <= 1
    # ours checks its sampler's log-probs against the trainer's own forward (2 updates: the first one's)
    assert runs["ours-gspo"]["logprob_gap"][0] is not None
    s = result["summary"]["chain_sum"]
    assert 0 <= s["before"] <= 1 and s["step_ratio_ours_gspo_over_trl"] > 0
    md = next(tmp_path.glob("*.md")).read_text()
    assert "| chain_sum | trl |" in md and "ours-gspo / trl" in md
    assert next(tmp_path.glob("*.png")).stat().st_size > 1000


def test_the_bench_rewards_trl_as_our_grader_spec_rewards_ours():
    """TRL's reward function (bench.real_trainers.reward, Python) and ours (the REWARD grader spec, run by the
    graders) give every completion the same reward: the task's own score of the answer read as a number."""
    from bench.real_trainers import REWARD, TASKS, RealWorkload, reward, rows
    from gspo_core.rewards import build_reward

    w = RealWorkload(model_dir="unused", task="basic_arithmetic", config=TASKS["basic_arithmetic"], size=4)
    item = rows(RealWorkload(**{**w.__dict__, "eval_prompts": 0}))[0][0]
    assert [m["role"] for m in item["messages"]] == ["user"], "the question alone: no system prompt to copy"
    right, wrong = item["answer"], str(int(item["answer"]) + 1)
    texts = [f"<answer>{right}</answer>", right, f"So, the sum is {right}.", f"It is {right}, no, {wrong}."]
    texts += [f"<answer>{wrong}</answer> though {right}", "no number here", ""]
    fn = build_reward(REWARD)
    try:
        ours = [g.reward for g in fn.score_batch([item] * len(texts), [{"output_text": t} for t in texts])]
    finally:
        fn.close()
    trl = [reward(t, item) for t in texts]
    assert ours == pytest.approx(trl)
    assert trl[:3] == [1.0, 1.0, 1.0], "a correct answer scores 1 in tags, bare or at the end of prose"
    assert trl[3:] == [0.0] * 4, "the last number counts, tags before prose, no number is no answer"


def test_the_bench_refuses_a_task_config_whose_held_out_split_comes_out_short():
    """One-digit two-term sums have ~200 questions, all among 2,000 training items: no held-out item is left,
    and an accuracy of 0 items must not read as 0.0 (it did once); the error names the task and the count."""
    from bench.real_trainers import RealWorkload, rows

    small = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    with pytest.raises(ValueError, match=r"chain_sum .* only \d+ of 8 held-out items"):
        rows(RealWorkload(model_dir="unused", task="chain_sum", config=small, size=2000, eval_prompts=8))
    assert len(rows(RealWorkload(model_dir="unused", task="chain_sum", config=small, size=20, eval_prompts=8))[1]) == 8

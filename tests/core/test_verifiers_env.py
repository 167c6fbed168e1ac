"""A verifiers environment (the task-centric contract of verifiers 0.4) as a job's environment: its runner in the
environments venv plays each episode against the job's chat endpoint, its rubric is the reward."""

from __future__ import annotations

import socket

import pytest

from gspo_core.config import JobSpec
from gspo_core.environments import EnvironmentSpecError, check_environment
from gspo_core.environments.verifiers_episodes import RunnerError, VerifiersRunner
from gspo_core.platform import RuntimeOptions
from tests.core.trainer_support import Recorder, one_torch_thread, train
from tests.support.verifiers_support import VF_TOY_DIR, envs_python

ENV = {"type": "verifiers", "id": "vf_toy", "args": {"repeat": 1}, "size": 3, "validation_size": 1}
HP = {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6, "mini_batches": 1, "eval_prompts": 1}


def runtime(allowed: tuple[str, ...] = ("vf_toy",)) -> RuntimeOptions:
    return RuntimeOptions(
        rollout_engine="transformers",
        envs_python=str(envs_python()),
        verifiers_environments=allowed,
        envs_path=(str(VF_TOY_DIR),),
    )


def test_the_spec_is_checked_without_the_library():
    assert check_environment(ENV).id == "vf_toy"
    for change, field in [
        ({"id": "../evil"}, "environment.id"),
        ({"id": ""}, "environment.id"),
        ({"size": 0}, "environment.size"),
        ({"timeout_s": 0}, "environment.timeout_s"),
        ({"module": "os"}, "environment.module"),
        ({"args": {"task": {"rewards": {"x": {"fn": "/tmp/evil.py:f"}}}}}, "environment.args"),  # code by path
        ({"args": {"system_prompt": "/etc/passwd"}}, "environment.args"),  # a file of the worker's
    ]:
        with pytest.raises(EnvironmentSpecError) as info:
            check_environment({**ENV, **change})
        assert info.value.field == field, change


def test_a_job_on_a_verifiers_environment_trains_on_its_rubric(tiny_model_dir, tmp_path):
    """Through the trainer: the environment's tasks are the rows, every episode is played by the runner against
    the job's endpoint, each completion's reward is its task's own @vf.reward of that completion, its metrics
    reach the step's, and the held-out task is evaluated the same way."""
    env = {**ENV, "args": {"repeat": 1, "fail_on": "yes"}, "size": 2}  # "yes": its episodes break
    spec = JobSpec(
        model=str(tiny_model_dir),
        environment=env,
        reward={"type": "verifiers"},
        hyperparameters=HP,
        output_dir=str(tmp_path / "out"),
    )
    rec = Recorder()
    with one_torch_thread():
        train(spec, rec, runtime=runtime())
    steps = dict(rec.steps)
    metrics = steps[1]
    # Both prompts train (size 2): "yes"'s two episodes broke in the environment, dropped and counted.
    assert metrics["rollouts_dropped"] == 2 and metrics["agent_errors/episode_error"] == 2
    assert metrics["turns/mean"] == 1
    assert "eval/reward/mean" in steps[0]  # the held-out task, before training
    ((_, rows),) = rec.samples
    assert sorted(row["item"]["answer"] for row in rows) == ["ok", "yes"]
    for row in rows:
        assert row["item"]["task"] == "vf_toy" and row["item"]["messages"][0]["content"].startswith("Say ")
        for shown in row["completions"]:
            said = shown["messages"][-1]
            assert said["role"] == "assistant" and shown["dropped"] == (row["item"]["answer"] == "yes")
            assert (shown["trained_tokens"] > 0) != shown["dropped"]  # a dropped episode trains no token
            if not shown["dropped"]:  # the task's own @vf.reward of exactly this completion
                assert shown["reward"] == (1.0 if row["item"]["answer"] in said["content"].lower() else 0.0)
    ok = [c for row in rows if row["item"]["answer"] == "ok" for c in row["completions"]]
    assert metrics["verifiers/chars/mean"] == pytest.approx(sum(len(c["messages"][-1]["content"]) for c in ok) / 2)


def test_only_allowed_environments_run_a_failed_episode_is_an_error_and_a_missing_one_is_named():
    env = check_environment(ENV)
    with pytest.raises(EnvironmentSpecError) as info:
        VerifiersRunner(env, runtime(allowed=("other",)))
    assert info.value.field == "environment.id" and "allowed: other" in info.value.message
    runner = VerifiersRunner(env, runtime())
    try:
        train_rows, held_out = runner.rows()
        assert [row["answer"] for row in train_rows + held_out] == ["ok", "yes", "no", "hi"]
        with socket.socket() as sock:  # a port nothing listens on: the episode's model call fails
            sock.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{sock.getsockname()[1]}/s/x/v1"
        result = runner.rollout(train_rows[0], dead, "key", 60.0)
        assert result.reward is None and result.error == "episode_error"
        assert runner.rollout(train_rows[0], dead, "key", 60.0).error == "episode_error"  # the runner lives on
    finally:
        runner.close()
    assert runner.proc.returncode == 0
    unknown = VerifiersRunner(check_environment({**ENV, "args": {"words": ["a"], "colour": 1}}), runtime())
    try:
        with pytest.raises(
            RunnerError, match=r"'colour' is not a config field of vf_toy \(known: fail_on, repeat, words\)"
        ):
            unknown.rows()
    finally:
        unknown.close()
    missing = check_environment({**ENV, "id": "no_such_env"})
    runner = VerifiersRunner(missing, runtime(allowed=("no_such_env",)))
    try:
        with pytest.raises(RunnerError, match="no_such_env"):
            runner.rows()
    finally:
        runner.close()
    assert runner.proc.returncode == 0


def test_the_verifiers_grader_reads_the_episodes_own_scores():
    from gspo_core.rewards import RewardSpecError, build_reward
    from gspo_core.rewards.base import sample_for

    episode = {**sample_for("ok", 1), "environment": {"reward": 0.75, "metrics": {"said_it": 1.0, "chars": 2.0}}}
    dry = sample_for("ok", 1)  # a dry run's sample: no episode, no scores
    spec = {
        "type": "multi",
        "graders": {"env": {"type": "verifiers"}, "chars": {"type": "verifiers", "score": "chars"}},
        "calculate_output": "env + 0.1 * chars",
    }
    reward = build_reward(spec)
    try:
        got, none = reward.score_batch([{}, {}], [episode, dry])
    finally:
        reward.close()
    assert got.reward == pytest.approx(0.95) and got.scores == {"env": 0.75, "chars": 2.0}
    assert none.reward == 0.0 and set(none.errors) == {"env", "chars"}
    with pytest.raises(RewardSpecError) as info:
        build_reward({"type": "verifiers", "scores": "x"})
    assert info.value.field == "scores"

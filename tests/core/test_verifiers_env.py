"""A verifiers environment (the task-centric contract of verifiers 0.4) as a job's environment: its runner in the
environments venv plays each episode against the job's chat endpoint, its rubric is the reward."""

from __future__ import annotations

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
    ]:
        with pytest.raises(EnvironmentSpecError) as info:
            check_environment({**ENV, **change})
        assert info.value.field == field, change


def test_a_job_on_a_verifiers_environment_trains_on_its_rubric(tiny_model_dir, tmp_path):
    """Through the trainer: the environment's tasks are the rows, every episode is played by the runner against
    the job's endpoint, each completion's reward is its task's own @vf.reward of that completion, its metrics
    reach the step's, and the held-out task is evaluated the same way."""
    spec = JobSpec(
        model=str(tiny_model_dir),
        environment=ENV,
        reward={"type": "verifiers"},
        hyperparameters=HP,
        output_dir=str(tmp_path / "out"),
    )
    rec = Recorder()
    with one_torch_thread():
        train(spec, rec, runtime=runtime())
    steps = dict(rec.steps)
    metrics = steps[1]
    assert metrics["rollouts_dropped"] == 0 and metrics["turns/mean"] == 1
    assert metrics["reward/mean"] == pytest.approx(metrics["verifiers/said_it/mean"])
    assert "eval/reward/mean" in steps[0]  # the held-out task, before training
    ((_, rows),) = rec.samples
    seen = 0
    for row in rows:
        assert row["item"]["task"] == "vf_toy" and row["item"]["messages"][0]["content"].startswith("Say ")
        for shown in row["completions"]:
            said = shown["messages"][-1]
            assert said["role"] == "assistant" and shown["trained_tokens"] > 0
            assert shown["reward"] == (1.0 if row["item"]["answer"] in said["content"].lower() else 0.0)
            seen += 1
    assert seen == 4
    assert metrics["verifiers/chars/mean"] >= 0


def test_only_allowed_environments_run_and_a_missing_one_is_named(tiny_model_dir):
    env = check_environment(ENV)
    with pytest.raises(EnvironmentSpecError) as info:
        VerifiersRunner(env, runtime(allowed=("other",)))
    assert info.value.field == "environment.id" and "allowed: other" in info.value.message
    missing = check_environment({**ENV, "id": "no_such_env"})
    runner = VerifiersRunner(missing, runtime(allowed=("no_such_env",)))
    try:
        with pytest.raises(RunnerError, match="no_such_env"):
            runner.rows()
    finally:
        runner.close()
    assert runner.proc.returncode == 0

"""A job's environment: reasoning-gym items by seed, a disjoint held-out split, the tasks' own scorers, spec
errors naming the field, generators stopped in the grader pool within their time and memory, and a `gspo train`
run on one with its evaluation before and after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from gspo_core.config import GSPOConfig, JobSpec
from gspo_core.data import load_rows
from gspo_core.environments import (
    EnvironmentSpecError,
    check_environment,
    environment_preview,
    environment_rows,
    parse_environment,
    write_environment_rows,
)
from gspo_core.environments import reasoning_gym as rg
from gspo_core.environments.isolated import Isolation
from gspo_core.rewards import GraderPolicy, build_reward, sample_for
from gspo_core.rewards.pool import GRACE_S, pool_for

pytest.importorskip("reasoning_gym")

TWO_TASKS = {
    "type": "reasoning_gym",
    "tasks": [
        {"name": "basic_arithmetic", "weight": 2, "config": {"max_terms": 3, "max_digits": 2}},
        {"name": "chain_sum", "weight": 1},
    ],
    "seed": 7,
    "size": 200,
    "validation_size": 50,
}


def _rows(spec: dict) -> tuple[list[dict], list[dict]]:
    return environment_rows(check_environment(spec))


def test_items_are_a_function_of_the_seed_and_the_held_out_split_is_disjoint():
    train, held_out = _rows(TWO_TASKS)
    assert (train, held_out) == _rows(TWO_TASKS), "the same seed makes the same items"
    assert len(train) == 200 and len(held_out) == 50
    assert {row["task"] for row in train} == {"basic_arithmetic", "chain_sum"}
    assert not {row["question"] for row in train} & {row["question"] for row in held_out}
    assert len({row["question"] for row in held_out}) == len(held_out), "no question twice in the split"
    other, _ = _rows({**TWO_TASKS, "seed": 8})
    assert [row["question"] for row in other] != [row["question"] for row in train]
    assert environment_preview(check_environment(TWO_TASKS), 5) == train[:5]
    # An item is what a JSONL row is: JSON through and through, the question a chat message.
    assert json.loads(json.dumps(train)) == train
    assert train[0]["messages"][-1] == {"role": "user", "content": train[0]["question"]}


def test_items_do_not_depend_on_the_process():
    """Another interpreter (another hash seed) generates the same items: a resumed job trains on the same rows."""
    code = (
        "import json, sys; from gspo_core.environments import check_environment, environment_rows; "
        "print(json.dumps(environment_rows(check_environment(json.loads(sys.argv[1])))))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(TWO_TASKS)], capture_output=True, text=True, env=env, check=True
    )
    assert json.loads(out.stdout) == [list(part) for part in _rows(TWO_TASKS)]


def test_a_small_task_s_held_out_split_drops_the_training_questions():
    """Sums of two one-digit numbers are about a hundred questions: the training items hold most of them, and
    the held-out split keeps only the others (fewer than asked, never a training question)."""
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]}
    config |= {"allow_negation": False, "allow_parentheses": False}
    small = {
        "type": "reasoning_gym",
        "tasks": [{"name": "basic_arithmetic", "config": config}],
        "seed": 1,
        "size": 300,
        "validation_size": 100,
    }
    train, held_out = _rows(small)
    questions = {row["question"] for row in train}
    assert 0 < len(held_out) < 100
    assert not questions & {row["question"] for row in held_out}


PARITY_TASKS = ["basic_arithmetic", "chain_sum", "leg_counting", "spell_backward", "letter_counting"]


@pytest.mark.parametrize("task", PARITY_TASKS)
def test_scores_are_reasoning_gyms_own(task):
    """Our score of an item (stored as JSON) is the score reasoning-gym's own dataset gives its raw entry,
    for right, wrong, partial and missing answers."""
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec

    spec = {"type": "reasoning_gym", "tasks": [{"name": task}], "seed": 3, "size": 12, "validation_size": 0}
    train, _ = _rows(spec)
    theirs = reasoning_gym.create_dataset("composite", seed=3, size=12, datasets=[DatasetSpec(task, 1.0, {})])
    for i, item in enumerate(train):
        entry = theirs[i]
        assert item["question"] == entry["question"]
        answers = [entry["answer"], entry["answer"] + "0", str(entry["answer"])[:1], "", None, "nonsense"]
        for answer in answers:
            assert rg.score(answer, item) == theirs.score_answer(answer, entry), (task, answer)


def test_the_grader_extracts_the_answer_and_scores_it_inside_multi():
    train, _ = _rows({**TWO_TASKS, "size": 4, "validation_size": 0})
    item = train[0]
    spec = {
        "type": "multi",
        "graders": {
            "answer": {"type": "reasoning_gym"},
            "tagged": {"type": "regex", "pattern": "<answer>.*</answer>"},
        },
        "calculate_output": "0.8 * answer + 0.2 * tagged",
    }
    fn = build_reward(spec)
    try:
        texts = [
            f"Let me think.\n<answer>{item['answer']}</answer>",  # tags: read inside them
            f"The sum is\n{item['answer']}",  # no tags: the last non-empty line
            "<answer>none</answer>",
        ]
        results = fn.score_batch([item] * 3, [sample_for(t, 5) for t in texts])
    finally:
        fn.close()
    assert [r.scores["answer"] for r in results] == [1.0, 1.0, 0.0]
    assert [round(r.reward, 6) for r in results] == [1.0, 0.8, 0.2]
    assert rg.extract_answer("x\n<answer> 4 </answer>\ny", "answer_tag") == "4"
    assert rg.extract_answer("no tags\n 5 \n", "answer_tag") is None
    assert rg.extract_answer("no tags\n 5 \n") == "5"
    # `number`: the tags first, else the last number as prose writes it; none at all: no answer
    assert rg.extract_answer("17 + 25 = 42.", "number") == "42"
    assert rg.extract_answer("The legs total -1,234.5 here", "number") == "-1234.5"
    assert rg.extract_answer("It is 3, or <answer>4</answer> then 9", "number") == "4"
    assert rg.extract_answer("no digits", "number") is None


@pytest.mark.parametrize(
    "change,field,message",
    [
        ({"type": "gym"}, "environment.type", "'gym' is not a known type .*reasoning_gym, openenv, verifiers\\)"),
        ({"type": "verifiers"}, "environment.id", "Field required"),
        ({"tasks": [{"name": "basic_arithmetics"}]}, "environment.tasks[0].name", "known: .*basic_arithmetic, "),
        (
            {"tasks": [{"name": "chain_sum"}, {"name": "basic_arithmetic", "config": {"max_term": 3}}]},
            "environment.tasks[1].config.max_term",
            "not a config field of basic_arithmetic \\(known: .*max_terms",
        ),
        ({"tasks": [{"name": "chain_sum", "config": {"seed": 3}}]}, "environment.tasks[0].config.seed", "own `seed`"),
        (
            {"tasks": [{"name": "basic_arithmetic", "config": {"min_terms": 5, "max_terms": 2}}]},
            "environment.tasks[0].config",
            "max_terms must be >= min_terms",
        ),
        ({"tasks": [{"name": "chain_sum"}, {"name": "chain_sum"}]}, "environment.tasks[1].name", "named twice"),
        ({"tasks": []}, "environment.tasks", "at least 1"),
        ({"tasks": [{"name": "chain_sum", "weight": 0}]}, "environment.tasks[0].weight", "greater than 0"),
        ({"size": 0}, "environment.size", "greater than or equal to 1"),
        ({"sizes": 3}, "environment.sizes", "Extra inputs"),
    ],
)
def test_bad_specs_name_the_field(change, field, message):
    with pytest.raises(EnvironmentSpecError, match=message) as caught:
        check_environment({**TWO_TASKS, **change})
    assert caught.value.field == field


#: The pool the isolated generators of these tests run in (a memory cap a test reaches in seconds).
POOL = GraderPolicy(pool_size=2, pool_memory_mb=512)


def looping(digits: int) -> dict:
    """basic_arithmetic dividing by trial: its generator tries every divisor below 10**digits, in Python (12
    digits: hours for the first item)."""
    config = {"min_terms": 2, "max_terms": 2, "min_digits": digits, "max_digits": digits, "operators": ["/"]}
    return {"name": "basic_arithmetic", "config": {**config, "allow_parentheses": False}}


def _warm_pool() -> None:
    """Every process of the pool started and holding reasoning-gym's imports (done outside a call's time), so
    what a test times is the generator's."""
    pool = pool_for(POOL)
    pool.start()
    deadline = time.monotonic() + 120
    while len(pool.pids()) < pool.size:
        assert time.monotonic() < deadline, "the grader pool did not start"
        time.sleep(0.05)
    for _ in range(pool.size):  # the idle processes are taken in turn
        check_environment(TWO_TASKS, Isolation(POOL, 60.0))


def test_a_generator_that_never_ends_is_stopped_within_its_time_and_the_pool_serves_on():
    """The check (one call per task: the one that overruns is named), the preview and the worker's generation
    each stop a looping generator at their time and answer a spec error; the next check is answered at once."""
    _warm_pool()
    hostile = {**TWO_TASKS, "tasks": [{"name": "chain_sum"}, looping(12)]}
    started = time.monotonic()
    with pytest.raises(EnvironmentSpecError, match="basic_arithmetic's first item took longer than 2 s") as caught:
        check_environment(hostile, Isolation(POOL, 2.0, "GSPO_X"), 1 << 20)
    elapsed = time.monotonic() - started
    assert caught.value.field == "environment.tasks[1].config" and "GSPO_X" in caught.value.message
    assert 2.0 <= elapsed < 2.0 + GRACE_S + 1.0, elapsed
    started = time.monotonic()
    assert check_environment(TWO_TASKS, Isolation(POOL, 10.0), 1 << 20).size == 200
    assert time.monotonic() - started < 2.0
    env = parse_environment({**TWO_TASKS, "tasks": [looping(12)]})
    with pytest.raises(EnvironmentSpecError, match="generating 3 items took longer than 1 s"):
        environment_preview(env, 3, Isolation(POOL, 1.0))
    with pytest.raises(EnvironmentSpecError, match="generating the items took longer than 1 s") as caught:
        write_environment_rows(env, os.devnull, os.devnull, Isolation(POOL, 1.0), 1 << 30, 1 << 20)
    assert caught.value.field == "environment"


def test_a_generator_past_the_pool_s_memory_cap_is_a_spec_error():
    """Terms of 4000 digits, a million of them: gigabytes, refused at the pool process's address-space cap."""
    _warm_pool()
    config = {"min_digits": 4000, "max_digits": 4000, "min_terms": 10**6, "max_terms": 10**6}
    hostile = {**TWO_TASKS, "tasks": [{"name": "chain_sum", "config": config}]}
    with pytest.raises(EnvironmentSpecError, match="first item ran out of memory \\(512 MB\\)") as caught:
        check_environment(hostile, Isolation(POOL, 60.0), 1 << 20)
    assert caught.value.field == "environment.tasks[0].config"


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_a_generator_s_process_that_stops_answering_is_killed_and_replaced(sig):
    """A process that hangs where its alarm cannot reach (stopped, as one stuck in C code is) is killed at the
    time plus the grace; one that dies is reported; either way the pool starts another. (A pool of one: the
    process signalled is the call's.)"""
    single = GraderPolicy(pool_size=1, pool_memory_mb=512)
    check_environment(TWO_TASKS, Isolation(single, 60.0))  # started, imports held
    (pid,) = pool_for(single).pids()
    caught: list[EnvironmentSpecError] = []
    budget = 6.0  # room for the call to reach the process on a loaded machine before the signal does

    def preview() -> None:
        env = parse_environment({**TWO_TASKS, "tasks": [looping(12)]})
        with pytest.raises(EnvironmentSpecError) as error:
            environment_preview(env, 1, Isolation(single, budget))
        caught.append(error.value)

    thread = threading.Thread(target=preview)
    started = time.monotonic()
    thread.start()
    time.sleep(2.5)  # in its generator by now
    os.kill(pid, sig)
    thread.join(30)
    elapsed = time.monotonic() - started
    expected = "took longer than 6 s" if sig == signal.SIGSTOP else "generating 1 item, the process died (signal 9)"
    assert caught and caught[0].field == "environment" and expected in caught[0].message, caught
    assert elapsed < budget + GRACE_S + 1.0, elapsed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed (a stopped one too), and reaped
    assert check_environment(TWO_TASKS, Isolation(single, 60.0)).size == 200
    assert pool_for(single).pids() not in ([], [pid])


def test_the_worker_s_files_are_the_items_and_the_byte_caps_name_the_field(tmp_path):
    """The files a pool process writes are the items :func:`environment_rows` makes; an item past the row cap
    names its task's config, items past the total cap the environment's size; the check refuses a first item
    past the row cap."""
    iso = Isolation(POOL, 60.0)
    env = check_environment(TWO_TASKS, iso, 1 << 20)
    train, held_out = str(tmp_path / "train.jsonl"), str(tmp_path / "val.jsonl")
    assert write_environment_rows(env, train, held_out, iso, 1 << 30, 1 << 20) == (200, 50)
    assert (load_rows(train), load_rows(held_out)) == environment_rows(env)
    with pytest.raises(EnvironmentSpecError, match="items take more than 10000 bytes") as caught:
        write_environment_rows(env, train, held_out, iso, 10_000, 1 << 20)
    assert caught.value.field == "environment.size"
    with pytest.raises(EnvironmentSpecError, match=r"an item of basic_arithmetic is \d+ bytes") as caught:
        write_environment_rows(env, train, held_out, iso, 1 << 30, 200)
    assert caught.value.field == "environment.tasks[0].config"
    long_terms = {"min_digits": 4000, "max_digits": 4000, "min_terms": 300, "max_terms": 300}
    with pytest.raises(EnvironmentSpecError, match=r"first item is \d+ bytes, more than a dataset row") as caught:
        check_environment({**TWO_TASKS, "tasks": [{"name": "chain_sum", "config": long_terms}]}, iso, 1 << 20)
    assert caught.value.field == "environment.tasks[0].config"


def test_a_job_takes_files_or_an_environment():
    reward = {"type": "reasoning_gym"}
    assert JobSpec(model="m", environment=TWO_TASKS, reward=reward).training_file is None
    with pytest.raises(ValueError, match="training_file: required unless an environment"):
        JobSpec(model="m", reward=reward)
    with pytest.raises(ValueError, match="training_file: give files or an environment, not both"):
        JobSpec(model="m", training_file="t.jsonl", environment=TWO_TASKS, reward=reward)
    assert parse_environment(TWO_TASKS).validation_size == 50


def test_gspo_train_on_an_environment_records_the_evaluation_before_and_after(tmp_path, tiny_model_dir):
    """`gspo train job.yaml` with an environment: the held-out split is evaluated at step 0 (greedy and sampled)
    and after the last step, as step metrics; the reward is the tasks' own scorer."""
    from gspo_core.cli import main

    job = {
        "model": str(tiny_model_dir),
        "environment": {
            "type": "reasoning_gym",
            "tasks": [{"name": "basic_arithmetic", "config": {"max_terms": 2, "max_digits": 1}}],
            "size": 8,
            "validation_size": 3,
            "system_prompt": None,
        },
        "reward": {"type": "reasoning_gym", "name": "answer"},
        "hyperparameters": {
            **{"steps": 2, "prompts_per_step": 2, "group_size": 2, "mini_batches": 1, "max_new_tokens": 4},
            "eval_prompts": 3,
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["train", str(path), "--output-dir", str(tmp_path / "out"), "--rollout-engine", "transformers"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    for line in (lines[0], lines[2]):
        assert line["eval/prompts"] == 3
        assert 0 <= line["eval/greedy/reward/mean"] <= 1 and 0 <= line["eval/reward/mean"] <= 1
        assert "eval/greedy/reward/answer/mean" in line
    assert "eval/greedy/reward/mean" not in lines[1] and "reward/answer/mean" in lines[1]
    assert GSPOConfig().eval_every == 0, "without eval_every: only before and after"

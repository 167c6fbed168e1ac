"""OpenEnv servers as a job's environment: a real server built from the `openenv` package's own classes (in its
own venv), its observations as masked user turns after exactly the sampled ids, its rewards summed, its headers
sent, and the egress policy's refusals; a server that dies mid-episode drops the rollouts and is counted."""

from __future__ import annotations

import pytest
import torch

from gspo_core import step as phases
from gspo_core.agents.episodes import EpisodeSettings
from gspo_core.agents.render import tool_turn_ids
from gspo_core.config import GSPOConfig, JobSpec
from gspo_core.environments import EnvironmentSpecError, check_environment, episode_environment
from gspo_core.policy import load_policy
from gspo_core.rollout.hf_engine import TransformersEngine
from tests.conftest import grader_policy
from tests.core.agents_support import episode_logprobs
from tests.core.net_support import loopback_name
from tests.core.trainer_support import Recorder, one_torch_thread, train
from tests.support.openenv_support import TOKEN, OpenEnvServer, step_reward

LOOPBACK = grader_policy(egress_allow=("127.0.0.1",))


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def guess_server(tmp_path_factory):
    server = OpenEnvServer(tmp_path_factory.mktemp("openenv") / "server.log", "--token", TOKEN)
    yield server
    server.close()


def env_spec(url: str, **over) -> dict:
    return {
        "type": "openenv",
        "url": url,
        "headers": {"Authorization": f"Bearer {TOKEN}"},
        "max_turns": 3,
        "observation_field": "prompt",
        "size": 4,
        **over,
    }


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_episodes_are_the_servers_observations_after_exactly_the_sampled_ids(tiny_model_dir, guess_server):
    """Each episode resets its own session with its row's seed: the reset observation is the prompt, the model's
    turn the action, the next observation a masked user turn after the exact sampled ids (the trainer's log-probs
    of the sampled ids equal the sampler's), the server's done ends it (2 steps, within max_turns 3), and its
    reward is the sum of the steps' rewards."""
    model, tok = load_policy(str(tiny_model_dir), GSPOConfig(), torch.device("cpu"))
    cfg = GSPOConfig(prompts_per_step=2, group_size=2, max_new_tokens=48, max_turn_tokens=6, mini_batches=1)
    factory = episode_environment(env_spec(guess_server.url), LOOPBACK, cfg.max_prompt_tokens)
    assert factory is not None
    agent = EpisodeSettings(factory.env.max_turns, cfg.max_turn_tokens, None, None, factory)
    rows = [{"prompt": "p", "seed": 5}, {"prompt": "p", "seed": 6}]
    rollout = phases.sample(TransformersEngine(model, tok), tok, rows, ["p", "p"], cfg, seed=3, agent=agent)
    m = rollout.metrics
    assert (m["turns/mean"], m["openenv/steps"], m["rollouts_dropped"]) == (2, 8, 0) and m["time/openenv"] > 0
    for c in rollout.completions:
        seed = rows[c.prompt_index]["seed"]
        first = [{"role": "user", "content": f"word {seed}?"}]
        prompt = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
        assert c.prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
        runs = _runs(c.mask)
        assert [value for value, _, _ in runs] == [1, 0, 1], runs
        (_, a, b), (_, _, e), (_, d, f) = runs
        turn1, env, turn2 = c.completion_ids[a:b], c.completion_ids[b:e], c.completion_ids[d:f]
        stop = tok.eos_token if turn1[-1] == tok.eos_token_id else ""
        assert env == tool_turn_ids(tok, [{"role": "user", "content": f"again {seed}.1?"}], stop)
        said = [tok.decode(turn1, skip_special_tokens=True), tok.decode(turn2, skip_special_tokens=True)]
        assert c.episode.messages == [
            first[0],
            {"role": "assistant", "content": said[0]},
            {"role": "user", "content": f"again {seed}.1?"},
            {"role": "assistant", "content": said[1]},
        ]
        assert c.episode.outcome.step_rewards == (step_reward(said[0]), step_reward(said[1]))
        assert c.episode.outcome.reward == step_reward(said[0]) + step_reward(said[1]) and not c.dropped
    logp_BT, masked = episode_logprobs(model, rollout.completions, tok.pad_token_id, cfg.temperature)
    for row, c in enumerate(rollout.completions):
        sampler = torch.tensor(c.logprobs) * masked.mask_BT[row, : len(c.logprobs)]
        torch.testing.assert_close(logp_BT[row, : len(c.logprobs)], sampler, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_server_that_keeps_its_episode_between_http_calls_plays_over_http(tiny_model_dir, tmp_path):
    """`transport: http`: POST /reset and /step (the headers sent with each) play the episode on a server whose
    HTTP routes share one environment: the same turns, observations and summed rewards as over the WebSocket."""
    server = OpenEnvServer(tmp_path / "http.log", "--one-environment")
    try:
        model, tok = load_policy(str(tiny_model_dir), GSPOConfig(), torch.device("cpu"))
        cfg = GSPOConfig(prompts_per_step=1, group_size=2, max_new_tokens=48, max_turn_tokens=6, mini_batches=1)
        spec = env_spec(server.url, transport="http")
        factory = episode_environment(spec, LOOPBACK, cfg.max_prompt_tokens)
        assert factory is not None
        agent = EpisodeSettings(3, cfg.max_turn_tokens, None, None, factory)
        rows = [{"prompt": "p", "seed": 9}]
        # One episode: the server has one environment for all calls.
        rollout = phases.sample(TransformersEngine(model, tok), tok, rows, ["p"], cfg, seed=3, n=1, agent=agent)
    finally:
        server.close()
    (c,) = rollout.completions
    assert (rollout.metrics["turns/mean"], rollout.metrics["openenv/steps"], c.dropped) == (2, 2, False)
    said = [m["content"] for m in c.episode.messages if m["role"] == "assistant"]
    assert [m["content"] for m in c.episode.messages if m["role"] == "user"] == ["word 9?", "again 9.1?"]
    assert c.episode.outcome.reward == sum(map(step_reward, said))


def _job(model_dir, tmp_path, url: str, **env) -> JobSpec:
    hp = {"steps": 1, "prompts_per_step": 2, "group_size": 2, "mini_batches": 1, "max_new_tokens": 48}
    return JobSpec(
        model=str(model_dir),
        environment=env_spec(url, **env),
        reward={"type": "openenv"},
        hyperparameters={**hp, "max_turn_tokens": 6, "samples_per_step": 2},
        output_dir=str(tmp_path / "out"),
    )


def test_an_openenv_job_trains_on_the_servers_rewards_and_shows_its_episodes(tiny_model_dir, tmp_path, guess_server):
    """Through the trainer: the server's rewards are the rollout's (its `last` mode: the last step's), the
    inspector's rows show each episode's transcript from the reset observation on, and nothing is dropped."""
    rec = Recorder()
    train(_job(tiny_model_dir, tmp_path, guess_server.url, episode_reward="last"), rec, grader_policy=LOOPBACK)
    ((step, metrics),) = rec.steps
    assert step == 1 and metrics["rollouts_dropped"] == 0 and metrics["openenv/steps"] == 8
    assert metrics["turns/mean"] == 2 and metrics["grad_norm"] > 0
    ((_, rows),) = rec.samples
    rewards = []
    for row in rows:
        assert row["item"]["seed"] in range(4)
        for shown in row["completions"]:
            said = [m["content"] for m in shown["messages"] if m["role"] == "assistant"]
            assert shown["messages"][0] == {"role": "user", "content": f"word {row['item']['seed']}?"}
            assert len(said) == 2 and shown["reward"] == step_reward(said[-1]) and not shown["dropped"]
            assert shown["trained_tokens"] > 0
            rewards.append(shown["reward"])
    assert metrics["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))


@pytest.mark.slow
def test_a_server_that_dies_mid_episode_drops_and_counts_the_rollouts(tiny_model_dir, tmp_path):
    """The server exits at the first step of any episode: every rollout is dropped and counted by kind, the
    step trains nothing, and the job goes on to its end."""
    server = OpenEnvServer(tmp_path / "dying.log", "--token", TOKEN, "--die-on-step", "1")
    try:
        rec = Recorder()
        result = train(_job(tiny_model_dir, tmp_path, server.url), rec, grader_policy=LOOPBACK)
    finally:
        server.close()
    ((_, metrics),) = rec.steps
    assert result.final_step == 1 and metrics["rollouts_dropped"] == 4 and metrics["grad_norm"] == 0
    errors = {k: v for k, v in metrics.items() if k.startswith("openenv_errors/")}
    assert sum(errors.values()) == 4, errors
    assert set(errors) <= {"openenv_errors/connection_closed", "openenv_errors/connection_error"}, errors
    assert all(shown["dropped"] for row in rec.samples[0][1] for shown in row["completions"])


def test_refused_addresses_and_headers_name_the_field(tiny_model_dir, tmp_path):
    """At submit (the operator's allow-list) and at the job's start (the worker's): a refused address names
    environment.url and a forbidden header its name; a name that resolves to a refused address passes the
    spec's check and is refused at connect: every episode dropped and counted, never a connection made."""
    for url, field in (("http://127.0.0.1:9", "environment.url"), ("http://[::1]:9", "environment.url")):
        with pytest.raises(EnvironmentSpecError) as exc:
            check_environment(env_spec(url), egress_allow=())
        assert exc.value.field == field and "loopback" in exc.value.message
    with pytest.raises(EnvironmentSpecError) as exc:
        check_environment(env_spec("https://env.example.com", headers={"Host": "x"}), egress_allow=())
    assert exc.value.field == "environment.headers.Host"
    with pytest.raises(EnvironmentSpecError, match=r"environment\.url"):
        train(_job(tiny_model_dir, tmp_path, "http://127.0.0.1:9"), Recorder(), grader_policy=grader_policy())
    name, _ = loopback_name()
    rec = Recorder()
    train(_job(tiny_model_dir, tmp_path, f"http://{name}:9"), rec, grader_policy=grader_policy())
    ((_, metrics),) = rec.steps
    assert metrics["rollouts_dropped"] == 4 and metrics["openenv_errors/egress_refused"] == 4


def test_the_openenv_grader_stands_for_the_servers_reward_only():
    """An openenv job's reward spec: it takes no fields, and a sample that is no openenv episode (a dry run, a
    job on files) has no server's reward: an error, scored 0, never a made-up reward."""
    from gspo_core.rewards import RewardSpecError, build_reward

    with pytest.raises(RewardSpecError, match="input: unknown field"):
        build_reward({"type": "openenv", "input": "x"})
    fn = build_reward({"type": "openenv"})
    try:
        (grade,) = fn.score_batch([{}], [{"output_text": "a"}])
    finally:
        fn.close()
    assert grade.reward == 0 and "only an openenv job's episodes" in grade.errors["openenv"]


def test_a_job_yaml_carries_the_environment_and_refuses_tools_beside_it(tiny_model_dir, tmp_path):
    """`gspo train job.yaml`: the environment reaches the JobSpec whole; tools beside an openenv environment are
    refused at the job's start, naming the field (the server is what answers the model)."""
    import yaml

    from gspo_core.cli import load_job

    env = env_spec("https://env.example.com")
    job = {"model": str(tiny_model_dir), "environment": env, "reward": {"type": "openenv"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    spec, _ = load_job(str(tmp_path / "job.yaml"), str(tmp_path / "out"), {})
    assert spec.environment == env
    tools = [{"type": "agent", "server_url": "https://agent.example.com"}]
    with pytest.raises(EnvironmentSpecError) as exc:
        train(spec.model_copy(update={"tools": tools}), Recorder(), grader_policy=grader_policy())
    assert exc.value.field == "tools"

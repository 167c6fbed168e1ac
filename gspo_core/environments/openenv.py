"""An OpenEnv server as the environment of the episode loop (`gspo_core.agents.episodes`): one session per episode,
its observations as user turns (masked environment ids), the model's turns as its actions, its rewards the
episode's reward; a session that fails drops its rollout and is counted, never fails the job."""

from __future__ import annotations

import contextlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from gspo_core.agents.episodes import _Episode
from gspo_core.agents.render import PlainText, tool_turn_ids
from gspo_core.environments.openenv_spec import HELD_OUT_SEED_OFFSET, OpenEnvEnvironment
from gspo_core.environments.openenv_wire import (
    HttpSession,
    OpenEnvError,
    Session,
    StepResult,
    WebSocketSession,
)
from gspo_core.rollout.base import Completion, EpisodeOutcome, SamplingSpec
from gspo_core.stopping import NEVER, StopCheck

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.rewards.policy import GraderPolicy

#: The item fields of an openenv row: a placeholder ``prompt`` (the inspector's; the episode's real first
#: message is the reset observation) and the ``seed`` its episodes reset with.
ITEM_FIELDS = ("prompt", "seed")
#: Observation fields left out of the JSON shown to the model when no ``observation_field`` is named.
NOT_SHOWN = ("reward", "done", "metadata")
#: Sessions of one rollout that talk to the server at once.
MAX_CONCURRENT_SESSIONS = 64


def check(env: OpenEnvEnvironment, egress_allow: tuple[str, ...] = ()) -> None:
    """The URL passes the egress policy (``environment.url``) and every header its rules
    (``environment.headers.<name>``); :class:`~gspo_core.environments.EnvironmentSpecError` otherwise."""
    from gspo_core.egress import UserUrlError, check_user_url, header_refusal
    from gspo_core.environments import EnvironmentSpecError

    try:
        check_user_url(env.url, egress_allow)
    except UserUrlError as exc:
        raise EnvironmentSpecError("environment.url", str(exc)) from None
    for name, value in env.headers.items():
        if why := header_refusal(name, value):
            raise EnvironmentSpecError(f"environment.headers.{name}", why)


def _row(seed: int) -> dict:
    return {"prompt": f"OpenEnv episode (reset seed {seed})", "seed": seed}


def rows(env: OpenEnvEnvironment) -> tuple[list[dict], list[dict]]:
    """``(training rows, held-out rows)``: row i resets with ``seed + i``; the held-out rows with seeds past
    :data:`HELD_OUT_SEED_OFFSET`, which no training row has."""
    train = [_row(env.seed + i) for i in range(env.size)]
    held_out = [_row(env.seed + HELD_OUT_SEED_OFFSET + i) for i in range(env.validation_size)]
    return train, held_out


def first_rows(env: OpenEnvEnvironment, n: int) -> list[dict]:
    return [_row(env.seed + i) for i in range(min(n, env.size))]


def observation_text(env: OpenEnvEnvironment, observation: dict[str, Any]) -> str:
    """What the model reads of an observation: the named field's text, or the observation as JSON."""
    if env.observation_field is None:
        shown = {k: v for k, v in observation.items() if k not in NOT_SHOWN}
        return json.dumps(shown, ensure_ascii=False, sort_keys=True, default=str)
    if env.observation_field not in observation:
        raise OpenEnvError("invalid_answer", f"the observation has no field {env.observation_field!r}")
    value = observation[env.observation_field]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


class OpenEnvFactory:
    """A job's OpenEnv server: makes each rollout's :class:`OpenEnvEpisodes` (``EpisodeSettings.agent``)."""

    def __init__(self, env: OpenEnvEnvironment, policy: GraderPolicy, max_prompt_tokens: int) -> None:
        check(env, policy.egress_allow)
        self.env, self.policy, self.max_prompt_tokens = env, policy, max_prompt_tokens

    def environment(
        self, tokenizer: PreTrainedTokenizerBase, rows: list[dict], stop: StopCheck = NEVER
    ) -> OpenEnvEpisodes:
        return OpenEnvEpisodes(self, tokenizer, rows, stop)

    def session(self) -> Session:
        from gspo_core.egress import EgressPolicy

        env, policy = self.env, EgressPolicy(self.policy.egress_allow)
        kind = WebSocketSession if env.transport == "websocket" else HttpSession
        return kind(env.url, dict(env.headers), policy, env.timeout_s)


@dataclass
class _Run:
    """One episode's session and what the server said: its rewards, and the error that ended it."""

    episode: _Episode
    seed: int
    session: Session | None = None
    rewards: list[float | None] = field(default_factory=list)
    error: str | None = None


class OpenEnvEpisodes:
    """One rollout's sessions as the loop's environment. ``open`` resets every session (concurrently) and makes
    each episode's prompt from its reset observation; ``react`` sends each live episode's turn as its action.
    The episode keeps its transcript and reward as an agent's episode does (``extra["agent"]``: the trainer
    takes the reward as given and shows the transcript whole). Metrics: ``openenv/steps`` (actions sent),
    ``openenv_errors/<kind>``, ``time/openenv`` (waiting on the server)."""

    shared_first_turn = False

    def __init__(
        self, factory: OpenEnvFactory, tokenizer: PreTrainedTokenizerBase, rows: list[dict], stop: StopCheck = NEVER
    ) -> None:
        self.factory, self.env, self.tokenizer, self.rows, self.stop = factory, factory.env, tokenizer, rows, stop
        self.runs: list[_Run] = []
        self.of: dict[int, _Run] = {}
        self.metrics: dict[str, float] = {"openenv/steps": 0.0, "time/openenv": 0.0}

    def _each(self, runs: list[_Run], act) -> None:
        """``act(run)`` for every run at once; a run whose call fails is ended with the error's kind."""
        if not runs:
            return
        start = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=min(MAX_CONCURRENT_SESSIONS, len(runs)), thread_name_prefix="openenv")
        try:
            futures = [pool.submit(self._guard, run, act) for run in runs]
            for future in futures:
                self.stop.result(future, math.inf)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            self.metrics["time/openenv"] += time.perf_counter() - start

    @staticmethod
    def _guard(run: _Run, act) -> None:
        try:
            act(run)
        except OpenEnvError as exc:
            run.error = exc.kind
        except Exception as exc:  # the egress policy's refusal, or whatever else broke this session alone
            from gspo_core.egress import EgressRefused

            run.error = "egress_refused" if isinstance(exc, EgressRefused) else "session_error"

    def open(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> list[_Episode]:
        self.spec = spec
        for p, ids in enumerate(prompt_ids):
            for _ in range(spec.n):
                run = _Run(_Episode(p, ids, outcome=EpisodeOutcome()), int(self.rows[p]["seed"]))
                self.runs.append(run)
                self.of[id(run.episode)] = run
        self._each(self.runs, self._reset)
        for run in self.runs:
            run.episode.done = run.error is not None
        return [run.episode for run in self.runs]

    def _reset(self, run: _Run) -> None:
        run.session = self.factory.session()
        result = run.session.reset(run.seed)
        text = observation_text(self.env, result.observation)
        messages = [{"role": "system", "content": self.env.system_prompt}] if self.env.system_prompt else []
        messages.append({"role": "user", "content": text})
        ids = PlainText(self.tokenizer).render(
            lambda hidden: cast(
                str, self.tokenizer.apply_chat_template(hidden, tokenize=False, add_generation_prompt=True)
            ),
            messages,
        )
        e = run.episode
        e.prompt_ids, e.messages = ids[-self.factory.max_prompt_tokens :], messages
        if result.done:  # an episode over at its reset: nothing to sample, nothing to train
            run.error = "done_at_reset"

    def react(self, live: list[_Episode], spec: SamplingSpec, last: bool) -> list[_Episode]:
        runs = [self.of[id(e)] for e in live]
        self._each(runs, lambda run: self._step(run, spec, last))
        return [run.episode for run in runs if not run.episode.done]

    def _step(self, run: _Run, spec: SamplingSpec, last: bool) -> None:
        e, c = run.episode, cast(Completion, run.episode.last)
        e.messages.append({"role": "assistant", "content": c.text})
        result: StepResult = cast(Session, run.session).step({self.env.action_field: c.text})
        run.rewards.append(result.reward)
        if result.done or last:
            e.done = True
            return
        text = observation_text(self.env, result.observation)
        user = {"role": "user", "content": text}
        e.messages.append(user)
        if not e.add_environment(tool_turn_ids(self.tokenizer, [user], e.stop_text(self.tokenizer)), spec.max_tokens):
            e.messages.pop()  # the budget ended the episode before the observation was shown

    def close(self, episodes: list[_Episode]) -> None:
        """Close every session; each episode gets its reward, or is dropped (and counted) when its session
        failed."""
        self.metrics["openenv/steps"] = float(sum(len(run.rewards) for run in self.runs))
        for run in self.runs:
            if run.session is not None:
                with contextlib.suppress(Exception):  # a broken session: nothing more to say to it
                    run.session.close()
            self._outcome(run)

    def _outcome(self, run: _Run) -> None:
        e = run.episode
        if run.error is not None:
            e.dropped = e.done = True
            key = f"openenv_errors/{run.error}"
            self.metrics[key] = self.metrics.get(key, 0.0) + 1
        if not e.ids:  # never sampled: one untrained id stands for the row
            e.ids, e.mask = [self.tokenizer.eos_token_id or 0], [0]
            e.logprobs = [0.0] if self.spec.logprobs else []
        given = [r for r in run.rewards if r is not None]
        reward = None if run.error is not None else episode_reward(self.env, given)
        e.outcome = EpisodeOutcome(reward=reward, error=run.error, seed=run.seed, step_rewards=tuple(run.rewards))


def episode_reward(env: OpenEnvEnvironment, rewards: list[float]) -> float:
    """The episode's reward from its steps' rewards (those the server gave): their sum, or the last; 0 when
    the server gave none."""
    if not rewards:
        return 0.0
    return float(sum(rewards)) if env.episode_reward == "sum" else rewards[-1]

"""The rollout loop: every sample is an episode of turns; a one-turn episode is today's single completion.

Turn 1 samples ``G`` completions of every prompt in one engine call. While episodes go on, their
**environment** acts on the turn just sampled and appends its answer as environment ids: the job's tools
(`ToolEnvironment`: the calls of the whole batch run concurrently, their results rendered by the chat
template's tool role, `gspo_core.agents.render`) or the user's own agent (`gspo_core.agents.remote`: the
turn is the answer to the agent's chat request, its next request's new messages are the environment's
ids). The next turns of all live episodes are sampled in one engine call, each continuing from its exact
previous ids (prompt + sampled + environment), never from a re-tokenised transcript. The trajectory's
``completion_ids`` are those ids; its ``mask`` is 1 on exactly the sampled ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, cast

from gspo_core.agents.formats import Parser, ToolCall
from gspo_core.agents.render import tool_turn_ids
from gspo_core.agents.tools import Toolbox, ToolResult
from gspo_core.data import row_tool_names
from gspo_core.rollout.base import Completion, EpisodeInfo, EpisodeOutcome, RolloutEngine, SamplingSpec
from gspo_core.stopping import NEVER, StopCheck

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Environment(Protocol):
    """What answers the model between turns. ``open``: every episode of the rollout (prompt order), the
    live ones holding the context of their first turn; ``shared_first_turn``: turn 1 is the plain ``n``
    samples of each prompt. ``react``: acts on the turn the live episodes just sampled (``last``: no turn
    follows) and returns those that go on, their environment ids appended. ``close``: the episodes end."""

    shared_first_turn: bool
    metrics: dict[str, float]

    def open(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> list[_Episode]: ...

    def react(self, live: list[_Episode], spec: SamplingSpec, last: bool) -> list[_Episode]: ...

    def close(self, episodes: list[_Episode]) -> None: ...


class EnvironmentFactory(Protocol):
    """Makes one rollout's environment (the job's agent endpoint, `gspo_core.agents.remote.AgentEndpoint`)."""

    def environment(
        self, tokenizer: PreTrainedTokenizerBase, rows: list[dict], stop: StopCheck = NEVER
    ) -> Environment: ...


@dataclass(frozen=True)
class EpisodeSettings:
    """How episodes run: at most ``max_turns`` turns (model turns), each sampling at most ``max_turn_tokens``
    (0: no cap but the total), all turns' and environment tokens together at most the sampling spec's
    ``max_tokens`` (``max_new_tokens``, so the engine's context bound holds). The environment is the
    ``toolbox`` (with ``parser``) or the user's ``agent``; without either, or with one turn and no agent, an
    episode is one completion."""

    max_turns: int = 1
    max_turn_tokens: int = 0
    parser: Parser | None = None
    toolbox: Toolbox | None = None
    agent: EnvironmentFactory | None = None

    def turn_cap(self, left: int) -> int:
        return min(left, self.max_turn_tokens) if self.max_turn_tokens else left

    def environment(
        self, tokenizer: PreTrainedTokenizerBase, rows: list[dict], stop: StopCheck = NEVER
    ) -> Environment | None:
        """One rollout's environment; its waits (tools, agents) end early when ``stop`` says so."""
        if self.agent is not None:
            return self.agent.environment(tokenizer, rows, stop)
        if self.toolbox is None or self.parser is None or self.max_turns == 1:
            return None
        return ToolEnvironment(tokenizer, self.toolbox, self.parser, [row_tool_names(row) for row in rows], stop)


@dataclass
class _Episode:
    """One trajectory being built from ``prompt_ids``; ``last`` is its latest turn as the engine returned it;
    ``cap``: the environment's own cap on the next turn (0: none); ``done``: no turn follows; ``discarded``:
    tokens it sampled that its row no longer holds (an agent's prefix break starts the row anew); ``outcome``:
    set from the start by an environment that keeps its own transcript, its end filled in when it closes."""

    prompt_index: int
    prompt_ids: list[int]
    first: Completion | None = None
    last: Completion | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    outcome: EpisodeOutcome | None = None
    turns: int = 0
    cap: int = 0
    done: bool = False
    dropped: bool = False
    truncated: bool = False
    discarded: int = 0

    def add_turn(self, c: Completion) -> None:
        self.first = self.first or c
        self.last, self.turns = c, self.turns + 1
        self.ids += c.completion_ids
        self.logprobs += c.logprobs
        self.mask += [1] * len(c.completion_ids)

    def stop_text(self, tokenizer: PreTrainedTokenizerBase) -> str:
        """The sampled EOS that ended the latest turn ("" when its cap cut it)."""
        last = cast(Completion, self.last)
        return cast(str, tokenizer.decode(last.completion_ids[-1:])) if last.finish_reason == "stop" else ""

    def add_environment(self, env: list[int], budget: int) -> bool:
        """Append the environment's ids unless the budget would leave the model no token (then the episode
        ends truncated). True when the episode goes on."""
        if len(self.ids) + len(env) >= budget:
            self.truncated = self.done = True
            return False
        self.ids += env
        self.mask += [0] * len(env)
        if self.logprobs:
            self.logprobs += [0.0] * len(env)
        return True

    def add_results(
        self, tokenizer: PreTrainedTokenizerBase, calls: list[ToolCall], results: list[ToolResult], budget: int
    ) -> bool:
        """Record a turn's calls and results; append the environment's ids unless the rollout is dropped or
        the budget would leave the model no token. True when the episode goes on."""
        last = cast(Completion, self.last)
        openai = [call.openai(f"call_{self.turns}_{j}") for j, call in enumerate(calls)]
        self.tool_calls += openai
        self.messages.append({"role": "assistant", "content": last.text, "tool_calls": openai})
        tool_msgs = [
            {"role": "tool", "tool_call_id": o["id"], "name": call.name, "content": result.text}
            for o, call, result in zip(openai, calls, results, strict=True)
        ]
        self.messages += tool_msgs
        if any(result.drop for result in results):
            self.dropped = self.done = True
            return False
        return self.add_environment(tool_turn_ids(tokenizer, tool_msgs, self.stop_text(tokenizer)), budget)

    def completion(self) -> Completion:
        """The trajectory as the trainer's row; a one-turn episode without calls or environment data is its
        turn as sampled. An environment that keeps its own transcript (an ``outcome``) gives
        ``messages`` whole."""
        if self.first is not None and not self.tool_calls and self.outcome is None:
            return self.first
        if self.last is not None and not self.dropped and not self.truncated and self.outcome is None:
            self.messages.append({"role": "assistant", "content": self.last.text})
        return Completion(
            prompt_index=self.prompt_index,
            prompt_ids=self.prompt_ids,
            completion_ids=self.ids,
            logprobs=self.logprobs,
            text=self.last.text if self.last else "",
            finish_reason="length" if self.truncated or self.last is None else self.last.finish_reason,
            episode=EpisodeInfo(self.turns, self.tool_calls, self.messages, self.outcome),
            mask=self.mask,
            dropped=self.dropped,
            discarded_tokens=self.discarded,
        )


class ToolEnvironment:
    """The job's tools: after a turn that ends (EOS) with calls, the calls of the whole batch run at once on
    the toolbox's thread pool (timed as ``time/tools``) and their results become environment ids.
    ``offered[p]``: the names of the tools prompt p's row offers (None: all the job's). An episode's tool
    state (its MCP sessions) is released as soon as it ends."""

    shared_first_turn = True

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        toolbox: Toolbox,
        parser: Parser,
        offered: list[frozenset[str] | None],
        stop: StopCheck = NEVER,
    ) -> None:
        self.tokenizer, self.toolbox, self.parser, self.offered = tokenizer, toolbox, parser, offered
        self.stop = stop
        self.metrics: dict[str, float] = {"time/tools": 0.0}

    def open(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> list[_Episode]:
        return [_Episode(p, ids) for p, ids in enumerate(prompt_ids) for _ in range(spec.n)]

    def react(self, live: list[_Episode], spec: SamplingSpec, last: bool) -> list[_Episode]:
        stopped = [] if last else [e for e in live if cast(Completion, e.last).finish_reason == "stop"]
        calling = [(e, calls) for e in stopped if (calls := self.parser(cast(Completion, e.last).text))]
        start = time.perf_counter()
        results = (
            self.toolbox.call_many(
                [call for _, calls in calling for call in calls],
                [id(e) for e, calls in calling for _ in calls],
                [self.offered[e.prompt_index] for e, calls in calling for _ in calls],
                self.stop,
            )
            if calling
            else []
        )
        self.metrics["time/tools"] += time.perf_counter() - start
        going, k = [], 0
        for e, calls in calling:
            mine, k = results[k : k + len(calls)], k + len(calls)
            for call, result in zip(calls, mine, strict=True):
                if result.error:
                    key = f"tool_errors/{call.name or 'unparsed'}/{result.error}"
                    self.metrics[key] = self.metrics.get(key, 0.0) + 1
            if e.add_results(self.tokenizer, calls, mine, spec.max_tokens):
                going.append(e)
        kept = {id(e) for e in going}
        if over := [id(e) for e in live if id(e) not in kept]:  # answered, dropped or out of budget
            self.toolbox.end_episodes(over)
        return going

    def close(self, episodes: list[_Episode]) -> None:
        self.toolbox.end_episodes([id(e) for e in episodes])


def run_episodes(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[list[int]],
    spec: SamplingSpec,
    settings: EpisodeSettings,
    rows: list[dict] | None = None,
    stop: StopCheck = NEVER,
) -> tuple[list[list[Completion]], dict[str, float]]:
    """``spec.n`` episodes per prompt, in prompt order, and their metrics (``turns/mean``,
    ``tool_calls/mean``, ``rollouts_dropped`` and the environment's own; none for one-turn settings).
    ``rows``: the prompts' dataset rows (what an agent gets as ``item``). ``stop``: checked before every turn
    and while tools and agents are waited for; when it says stop, `StepStopped` is raised and the episodes
    are abandoned (their environment closed without waiting)."""
    first = replace(spec, max_tokens=settings.turn_cap(spec.max_tokens))
    env = settings.environment(tokenizer, rows or [{} for _ in prompt_ids], stop)
    if env is None:
        return engine.generate(prompt_ids, first), {}
    episodes: list[_Episode] = []
    try:
        episodes = env.open(prompt_ids, spec)  # an agent's first requests are waited for here
        live = [e for e in episodes if not e.done]
        for turn in range(settings.max_turns):
            if not live:
                break
            stop.check()
            if turn == 0 and env.shared_first_turn:
                turns = [c for group in engine.generate(prompt_ids, first) for c in group]
            else:
                left = [min(e.cap or spec.max_tokens, spec.max_tokens - len(e.ids)) for e in live]
                caps = tuple(settings.turn_cap(n) for n in left)
                seed = spec.seed if spec.seed is None or turn == 0 else spec.seed + 7919 * turn
                nxt = replace(spec, n=1, max_tokens=max(caps), max_tokens_each=caps, seed=seed)
                turns = [c for (c,) in engine.generate([e.prompt_ids + e.ids for e in live], nxt)]
            for e, c in zip(live, turns, strict=True):
                e.add_turn(c)
            live = env.react(live, spec, last=turn == settings.max_turns - 1)
    finally:
        env.close(episodes)
    stop.check()  # a close whose wait for the agents was cut short: its rollout is not trained
    out: list[list[Completion]] = [[] for _ in prompt_ids]
    for e in episodes:
        out[e.prompt_index].append(e.completion())
    n = len(episodes)
    metrics = dict(env.metrics)
    metrics["turns/mean"] = sum(e.turns for e in episodes) / n
    metrics["tool_calls/mean"] = sum(len(e.tool_calls) for e in episodes) / n
    metrics["rollouts_dropped"] = float(sum(e.dropped for e in episodes))
    return out, metrics

"""The rollout loop: every sample is an episode of turns; a one-turn episode is today's single completion.

Turn 1 samples ``G`` completions of every prompt in one engine call. While episodes end a turn (EOS) with
tool calls, the calls of the whole batch run concurrently, their results are appended as environment ids
(the chat template's tool role, `gspo_core.agents.render`), and the next turns of all live episodes are
sampled in one engine call, each continuing from its exact previous ids (prompt + sampled + environment),
never from a re-tokenised transcript. The trajectory's ``completion_ids`` are those ids; its ``mask`` is 1
on exactly the sampled ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

from gspo_core.agents.formats import Parser, ToolCall
from gspo_core.agents.render import tool_turn_ids
from gspo_core.agents.tools import Toolbox, ToolResult
from gspo_core.rollout.base import Completion, RolloutEngine, SamplingSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class EpisodeSettings:
    """How episodes run: at most ``max_turns`` turns (model turns), each sampling at most ``max_turn_tokens``
    (0: no cap but the total), all turns' and tool results' tokens together at most the sampling spec's
    ``max_tokens`` (``max_new_tokens``, so the engine's context bound holds). Without ``toolbox`` or with one
    turn, an episode is one completion."""

    max_turns: int = 1
    max_turn_tokens: int = 0
    parser: Parser | None = None
    toolbox: Toolbox | None = None

    def turn_cap(self, left: int) -> int:
        return min(left, self.max_turn_tokens) if self.max_turn_tokens else left


@dataclass
class _Episode:
    """One trajectory being built; ``last`` is its latest turn as the engine returned it."""

    first: Completion
    last: Completion
    ids: list[int]
    logprobs: list[float]
    mask: list[int]
    messages: list[dict] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    turns: int = 1
    dropped: bool = False
    truncated: bool = False

    @classmethod
    def start(cls, c: Completion) -> _Episode:
        return cls(c, c, list(c.completion_ids), list(c.logprobs), [1] * len(c.completion_ids))

    def add_turn(self, c: Completion) -> None:
        self.last, self.turns = c, self.turns + 1
        self.ids += c.completion_ids
        self.logprobs += c.logprobs
        self.mask += [1] * len(c.completion_ids)

    def add_results(
        self, tokenizer: PreTrainedTokenizerBase, calls: list[ToolCall], results: list[ToolResult], budget: int
    ) -> bool:
        """Record a turn's calls and results; append the environment's ids unless the rollout is dropped or
        the budget would leave the model no token. True when the episode goes on."""
        openai = [call.openai(f"call_{self.turns}_{j}") for j, call in enumerate(calls)]
        self.tool_calls += openai
        self.messages.append({"role": "assistant", "content": self.last.text, "tool_calls": openai})
        tool_msgs = [
            {"role": "tool", "tool_call_id": o["id"], "name": call.name, "content": result.text}
            for o, call, result in zip(openai, calls, results, strict=True)
        ]
        self.messages += tool_msgs
        if any(result.drop for result in results):
            self.dropped = True
            return False
        stop = cast(str, tokenizer.decode(self.last.completion_ids[-1:])) if self.last.finish_reason == "stop" else ""
        env = tool_turn_ids(tokenizer, tool_msgs, stop)
        if len(self.ids) + len(env) >= budget:
            self.truncated = True
            return False
        self.ids += env
        self.mask += [0] * len(env)
        if self.logprobs:
            self.logprobs += [0.0] * len(env)
        return True

    def completion(self) -> Completion:
        if not self.tool_calls:
            return self.first
        if not self.dropped and not self.truncated:
            self.messages.append({"role": "assistant", "content": self.last.text})
        return Completion(
            prompt_index=self.first.prompt_index,
            prompt_ids=self.first.prompt_ids,
            completion_ids=self.ids,
            logprobs=self.logprobs,
            text=self.last.text,
            finish_reason="length" if self.truncated else self.last.finish_reason,
            extra={"turns": self.turns, "tool_calls": self.tool_calls, "messages": self.messages},
            mask=self.mask,
            dropped=self.dropped,
        )


def run_episodes(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[list[int]],
    spec: SamplingSpec,
    settings: EpisodeSettings,
    offered: list[frozenset[str] | None] | None = None,
) -> tuple[list[list[Completion]], dict[str, float]]:
    """``spec.n`` episodes per prompt, in prompt order, and their metrics (``turns/mean``,
    ``tool_calls/mean``, ``tool_errors/<tool>/<kind>``, ``rollouts_dropped``, ``time/tools``; none for
    one-turn settings). ``offered[p]``: the names of the tools prompt p's row offers (None: all the job's)."""
    groups = engine.generate(prompt_ids, replace(spec, max_tokens=settings.turn_cap(spec.max_tokens)))
    if settings.toolbox is None or settings.parser is None or settings.max_turns == 1:
        return groups, {}
    toolbox = settings.toolbox
    episodes = [_Episode.start(c) for group in groups for c in group]
    metrics: dict[str, float] = {"time/tools": 0.0}
    try:
        _run_turns(engine, tokenizer, spec, settings, episodes, offered or [None] * len(prompt_ids), metrics)
    finally:  # an episode's tool state (its MCP sessions) lives as long as the episode
        toolbox.end_episodes([id(e) for e in episodes])
    out: list[list[Completion]] = [[] for _ in prompt_ids]
    for e in episodes:
        out[e.first.prompt_index].append(e.completion())
    n = len(episodes)
    metrics["turns/mean"] = sum(e.turns for e in episodes) / n
    metrics["tool_calls/mean"] = sum(len(e.tool_calls) for e in episodes) / n
    metrics["rollouts_dropped"] = float(sum(e.dropped for e in episodes))
    return out, metrics


def _run_turns(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    spec: SamplingSpec,
    settings: EpisodeSettings,
    episodes: list[_Episode],
    offered: list[frozenset[str] | None],
    metrics: dict[str, float],
) -> None:
    """Turns 2..max_turns: every episode whose last turn called tools gets their results and samples on."""
    assert settings.toolbox is not None and settings.parser is not None
    toolbox, parser = settings.toolbox, settings.parser
    sampled = episodes  # the episodes whose latest turn was just sampled
    for turn in range(1, settings.max_turns):
        calling = [(e, parser(e.last.text)) for e in sampled if e.last.finish_reason == "stop" and not e.dropped]
        calling = [(e, calls) for e, calls in calling if calls]
        calls_now = {id(e) for e, _ in calling}
        if answered := [id(e) for e in sampled if id(e) not in calls_now]:  # these ended with their answer
            toolbox.end_episodes(answered)
        if not calling:
            break
        start = time.perf_counter()
        results = toolbox.call_many(
            [call for _, calls in calling for call in calls],
            [id(e) for e, calls in calling for _ in calls],
            [offered[e.first.prompt_index] for e, calls in calling for _ in calls],
        )
        metrics["time/tools"] += time.perf_counter() - start
        live, k = [], 0
        for e, calls in calling:
            mine, k = results[k : k + len(calls)], k + len(calls)
            for call, result in zip(calls, mine, strict=True):
                if result.error:
                    key = f"tool_errors/{call.name or 'unparsed'}/{result.error}"
                    metrics[key] = metrics.get(key, 0.0) + 1
            if e.add_results(tokenizer, calls, mine, spec.max_tokens):
                live.append(e)
        going = {id(e) for e in live}
        if ended := [id(e) for e, _ in calling if id(e) not in going]:  # dropped or out of budget: over
            toolbox.end_episodes(ended)
        if not live:
            break
        caps = tuple(settings.turn_cap(spec.max_tokens - len(e.ids)) for e in live)
        seed = None if spec.seed is None else spec.seed + 7919 * turn
        nxt = replace(spec, n=1, max_tokens=max(caps), max_tokens_each=caps, seed=seed)
        for e, (c,) in zip(live, engine.generate([e.first.prompt_ids + e.ids for e in live], nxt), strict=True):
            e.add_turn(c)
        sampled = live

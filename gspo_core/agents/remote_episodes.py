"""One rollout against the user's agents (`gspo_core.agents.remote`): a session per sample, each a thread POSTing
to the agent, as the environment of the one episode loop (`run_episodes`)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from gspo_core.agents.chat import (
    ChatRequest,
    error,
    reward_of,
    same_message,
    with_names,
)
from gspo_core.agents.episodes import _Episode
from gspo_core.agents.remote import MODEL_NAME, _Session
from gspo_core.agents.render import PlainText, tool_turn_ids
from gspo_core.rollout.base import Completion, EpisodeOutcome, SamplingSpec
from gspo_core.stopping import NEVER, StopCheck

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.agents.remote import AgentEndpoint


class AgentEnvironment:
    """One rollout's sessions (``n`` per prompt, each a thread POSTing to the agent) as the loop's
    environment. Metrics: ``agent/prefix_breaks``, ``agent_errors/<kind>``, ``time/agent`` (waiting on
    the agents between turns). ``stop``: its waits on the agents end when the step must stop."""

    shared_first_turn = False

    def __init__(
        self, endpoint: AgentEndpoint, tokenizer: PreTrainedTokenizerBase, rows: list[dict], stop: StopCheck = NEVER
    ) -> None:
        self.ep, self.tokenizer, self.rows, self.stop = endpoint, tokenizer, rows, stop
        self.sessions: list[_Session] = []
        self.of: dict[int, _Session] = {}
        self.metrics: dict[str, float] = {"agent/prefix_breaks": 0.0, "time/agent": 0.0}

    def open(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> list[_Episode]:
        from gspo_core.egress import EgressPolicy
        from gspo_core.egress_client import EgressClient

        self.spec = spec
        n = len(prompt_ids) * spec.n
        self.client = EgressClient(
            EgressPolicy(self.ep.policy.egress_allow), self.ep.timeout_s, self.ep.headers, max_connections=max(64, n)
        )
        with self.ep.cv:
            for p, ids in enumerate(prompt_ids):
                for _ in range(spec.n):
                    s = _Session(secrets.token_urlsafe(16), self.rows[p], _Episode(p, ids, outcome=EpisodeOutcome()))
                    self.ep.sessions[s.id] = s
                    self.sessions.append(s)
                    self.of[id(s.episode)] = s
        for s in self.sessions:
            threading.Thread(target=self._run, args=(s,), name="agent-session", daemon=True).start()
        for s in self._gather(self.sessions):
            self._guarded(s, partial(self._first, s))
        return [s.episode for s in self.sessions]

    def react(self, live: list[_Episode], spec: SamplingSpec, last: bool) -> list[_Episode]:
        for e in live:
            self._guarded(self.of[id(e)], partial(self._deliver, self.of[id(e)]))
        if last:
            with self.ep.cv:
                for s in self.sessions:
                    s.closed = True
            return []
        asking = self._gather([self.of[id(e)] for e in live if not e.done])
        return [s.episode for s in asking if self._guarded(s, partial(self._next, s, spec))]

    def close(self, episodes: list[_Episode]) -> None:
        """End every session: a pending request is refused, each agent's reply is awaited (its timeout),
        then each episode gets its reward, or is dropped (and counted) when its agent failed."""
        with self.ep.cv:
            for s in self.sessions:
                s.closed = True
                if s.request is not None:
                    self._answer(s, 400, error("the episode is over (max_turns)"))
            self.stop.wait_for(self.ep.cv, lambda: all(s.finished for s in self.sessions), self.ep.timeout_s)
            for s in self.sessions:
                self.ep.sessions.pop(s.id, None)
        self.client.close()
        for s in self.sessions:
            self._outcome(s)

    def _run(self, s: _Session) -> None:
        from gspo_core.egress import EgressRefused
        from gspo_core.egress_client import EgressError

        reward, kind = None, None
        body = {"item": s.item, "base_url": f"{self.ep.base}/s/{s.id}/v1", "session": s.id}
        try:
            status, reply = self.client.request("POST", self.ep.url, json=body)
            reward, kind = reward_of(reply) if status < 300 else (None, f"http_{status // 100}xx")
        except EgressRefused:
            kind = "egress_refused"
        except EgressError as exc:
            kind = "timeout" if exc.kind == "timeout" else "http_error"
        except Exception:  # whatever else broke this session must not stall the turn
            kind = "agent_error"
        with self.ep.cv:
            s.finished, s.reward, s.error = True, reward, s.error or kind
            self.ep.cv.notify_all()

    def _gather(self, sessions: list[_Session]) -> list[_Session]:
        """Wait until each session has a request or its agent answered (at most the agent's timeout): those
        with a request; the others' episodes end (a session that neither asked nor answered: ``timeout``)."""
        start = time.perf_counter()
        with self.ep.cv:
            pending = lambda: all(s.request is not None or s.finished for s in sessions)  # noqa: E731
            if not self.stop.wait_for(self.ep.cv, pending, self.ep.timeout_s):
                self.stop.check()  # stopped: the loop abandons the rollout (close() ends the sessions)
            asking = [s for s in sessions if s.request is not None]
            for s in sessions:
                if s.request is None:
                    s.closed = s.episode.done = True
                    s.error = s.error or (None if s.finished else "timeout")
        self.metrics["time/agent"] += time.perf_counter() - start
        return asking

    def _answer(self, s: _Session, status: int, obj: dict) -> None:
        """Hand the waiting connection its answer (the caller holds the condition)."""
        if s.reply is not None:
            s.reply.give((status, obj))
        s.request, s.reply = None, None

    def _refuse(self, s: _Session, why: str, kind: str | None = None) -> bool:
        """End the session's episode, its request answered 400 ``why``; ``kind``: an error that drops it."""
        with self.ep.cv:
            s.closed = s.episode.done = True
            s.episode.truncated = s.episode.last is not None
            s.error = s.error or kind
            self._answer(s, 400, error(why))
        return False

    def _guarded(self, s: _Session, handle: Callable[[], bool]) -> bool:
        """``handle()`` of one session's request: whatever in an agent's input still breaks it (the request
        was checked at the endpoint) ends that session, dropped and counted as ``invalid_request``, never
        the rollout of the job's other sessions."""
        try:
            return handle()
        except Exception as exc:
            return self._refuse(s, f"the request could not be used ({type(exc).__name__})", "invalid_request")

    def _cap(self, e: _Episode, asked: int) -> int:
        """The next turn's cap: the agent's, within what the episode's budget (``max_new_tokens``) leaves once
        the tokens sampled before a prefix break count too (0 when none is left)."""
        if not e.discarded:
            return asked
        left = max(self.spec.max_tokens - e.discarded - len(e.ids), 0)
        return min(asked or left, left)

    def _first(self, s: _Session) -> bool:
        """A session's context from its request rendered whole (its first, or after a prefix break); the
        agent's text is plain text, its special-token strings no control tokens."""
        req, e = cast(ChatRequest, s.request), s.episode

        def render(hidden: tuple[list[dict], list[dict] | None]) -> str:
            text = self.tokenizer.apply_chat_template(
                hidden[0], tools=hidden[1], tokenize=False, add_generation_prompt=True
            )
            return cast(str, text)

        try:
            ids = PlainText(self.tokenizer).render(render, (req.messages, req.tools))
        except Exception as exc:  # the template's own refusal (roles, tools) is the agent's to read
            return self._refuse(s, f"messages: the chat template refused them: {exc}")
        if len(ids) > self.ep.max_prompt_tokens:
            return self._refuse(s, f"messages: {len(ids)} tokens, more than max_prompt_tokens")
        spent = e.discarded + sum(e.mask)  # a prefix break: the tokens sampled so far leave the row, not the usage
        if spent >= self.spec.max_tokens:
            return self._refuse(s, "the episode's token budget (max_new_tokens) is spent")
        e.discarded, e.prompt_ids, e.ids, e.logprobs, e.mask = spent, ids, [], [], []
        e.cap, s.tools = self._cap(e, req.cap), req.tools
        return True

    def _next(self, s: _Session, spec: SamplingSpec) -> bool:
        """A later request: its new messages as environment ids when it extends the service's history
        exactly; else (history rewritten, tools changed) a prefix break: the context starts anew."""
        req, e = cast(ChatRequest, s.request), s.episode
        msgs, n = req.messages, len(s.history)
        suffix = msgs[n:]
        kept = (
            len(msgs) > n
            and all(same_message(a, b) for a, b in zip(s.history, msgs, strict=False))
            and req.tools == s.tools
            and all(m["role"] != "assistant" for m in suffix)
        )
        if not kept:
            self.metrics["agent/prefix_breaks"] += 1
            s.breaks += 1
            return self._first(s)
        env = tool_turn_ids(self.tokenizer, suffix, e.stop_text(self.tokenizer))
        if not e.add_environment(env, spec.max_tokens - e.discarded):
            return self._refuse(s, "the episode's token budget (max_new_tokens) is spent")
        e.cap = self._cap(e, req.cap)
        return True

    def _deliver(self, s: _Session) -> bool:
        """Answer the request the turn just sampled, in OpenAI's shape, with calls parsed by the job's format
        (only when the request offered tools)."""
        e, c = s.episode, cast(Completion, s.episode.last)
        calls = [call for call in self.ep.parser(c.text) if not call.error] if s.tools else []
        tool_calls = [with_names(call.openai(f"call_{e.turns}_{j}"), s.tools) for j, call in enumerate(calls)]
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        with self.ep.cv:
            s.history = [*cast(ChatRequest, s.request).messages, message]
            e.messages, e.tool_calls = list(s.history), e.tool_calls + tool_calls
            context = len(e.prompt_ids) + len(e.ids) - len(c.completion_ids)
            self._answer(
                s,
                200,
                {
                    "id": f"chatcmpl-{s.id[:8]}-{e.turns}",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": MODEL_NAME,
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "finish_reason": "tool_calls" if tool_calls else c.finish_reason,
                            "logprobs": None,
                        }
                    ],
                    "usage": {
                        "prompt_tokens": context,
                        "completion_tokens": len(c.completion_ids),
                        "total_tokens": context + len(c.completion_ids),
                    },
                },
            )
        return True

    def _outcome(self, s: _Session) -> None:
        """The session's end in its episode and the metrics (``agent/invalid_requests``: its requests refused as
        malformed, a 400 each)."""
        e = s.episode
        self.metrics["agent/invalid_requests"] = self.metrics.get("agent/invalid_requests", 0.0) + s.invalid
        if s.error is None and e.last is None:
            s.error = "no_request"
        if s.error is not None:
            e.dropped = True
            key = f"agent_errors/{s.error}"
            self.metrics[key] = self.metrics.get(key, 0.0) + 1
        if not e.ids:  # never sampled (or refused as its row started anew): one untrained id stands for the row
            e.ids, e.mask = [self.tokenizer.eos_token_id or 0], [0]
            e.logprobs = [0.0] if self.spec.logprobs else []
        e.outcome = EpisodeOutcome(reward=s.reward, error=s.error, session=s.id, prefix_breaks=s.breaks)

"""Bring your own agent: the user's agent server runs each rollout against an OpenAI-compatible chat endpoint
that this process opens on loopback; each rollout's sessions are the environment of the one episode loop
(`gspo_core.agents.remote_episodes`).

Per rollout the service POSTs ``{"item", "base_url", "session"}`` to the agent's ``server_url``; the agent
calls ``POST {base_url}/chat/completions``. A turn of the loop waits until every live session has a pending
request (or its agent has answered), samples all of them in one engine call, and answers each. The sampled
ids and log-probs are the trajectory's; an agent's next request that extends what the service produced adds
only its new messages, rendered as a suffix (`gspo_core.agents.render`), as environment ids.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from gspo_core.agents.bounded_http import Answer, BoundedServer, Limits, Request
from gspo_core.agents.chat import (
    ChatRequest,
    RequestError,
    error,
    parse_request,
)
from gspo_core.agents.episodes import _Episode
from gspo_core.agents.formats import Parser
from gspo_core.rewards.policy import GraderPolicy
from gspo_core.stopping import NEVER, StopCheck

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.agents.remote_episodes import AgentEnvironment

MODEL_NAME = "policy"


@dataclass
class _Reply:
    """The answer to one chat request, for the connection (on the server's loop) that awaits it."""

    server: BoundedServer
    future: asyncio.Future

    def give(self, answer: Answer) -> None:
        """Resolve the future from any thread (a connection that gave up waiting has cancelled it)."""

        def resolve() -> None:
            if not self.future.done():
                self.future.set_result(answer)

        self.server.call_soon(resolve)


@dataclass
class _Session:
    """One rollout's agent session; every field is read and written under the endpoint's condition."""

    id: str
    item: dict
    episode: _Episode
    request: ChatRequest | None = None
    reply: _Reply | None = None
    history: list[dict] = field(default_factory=list)
    tools: list | None = None
    closed: bool = False
    finished: bool = False
    reward: float | None = None
    error: str | None = None
    breaks: int = 0
    invalid: int = 0


class AgentEndpoint:
    """A job's agent: its server (``server_url``, ``headers``, ``timeout_s``) and the chat endpoint (one HTTP
    server per job on ``host:port``, loopback and a free port by default; each session's ``base_url`` is
    ``<url>/s/<random id>/v1``, ``url`` the address agents reach it at, default ``http://host:port``;
    ``limits``: what one connection and the job's connections may cost, `gspo_core.agents.bounded_http`)."""

    def __init__(
        self,
        spec: dict,
        policy: GraderPolicy,
        parser: Parser,
        max_prompt_tokens: int,
        host: str = "127.0.0.1",
        port: int = 0,
        url: str = "",
        limits: Limits | None = None,
    ) -> None:
        self.url, self.headers = spec["server_url"], dict(spec.get("headers") or {})
        self.timeout_s = float(spec.get("timeout_s", 300.0))
        self.policy, self.parser, self.max_prompt_tokens = policy, parser, max_prompt_tokens
        self.cv = threading.Condition()
        self.sessions: dict[str, _Session] = {}
        self.public_url = url.rstrip("/")
        self.server = BoundedServer(_Routes(self), host, port, limits or Limits(), "agent-endpoint")

    @property
    def base(self) -> str:
        host, port = self.server.address
        return self.public_url or f"http://{host!s}:{port}"

    def environment(
        self, tokenizer: PreTrainedTokenizerBase, rows: list[dict], stop: StopCheck = NEVER
    ) -> AgentEnvironment:
        from gspo_core.agents.remote_episodes import AgentEnvironment

        return AgentEnvironment(self, tokenizer, rows, stop)

    def known(self, sid: str | None) -> bool:
        with self.cv:
            return sid in self.sessions

    async def submit(self, sid: str, body: bytes) -> Answer:
        """An agent's chat request (on the server's loop): held until the loop's next turn answers it."""
        try:
            request: ChatRequest | RequestError = parse_request(body)
        except RequestError as exc:
            request = exc
        with self.cv:
            s = self.sessions.get(sid)
            if s is None:
                return 404, error("no such session", "not_found_error")
            if isinstance(request, RequestError):
                s.invalid += 1
                return 400, error(str(request))
            if s.closed:
                return 400, error("the episode is over (max_turns, its token budget, or a timeout)")
            if s.request is not None:
                return 409, error("one request at a time per session")
            s.request = request
            reply = s.reply = _Reply(self.server, asyncio.get_running_loop().create_future())
            self.cv.notify_all()
        try:
            return await asyncio.wait_for(reply.future, self.timeout_s)
        except TimeoutError:
            return 504, error("no answer in time")

    def close(self) -> None:
        self.server.close()


class _Routes:
    """``GET /s/<id>/v1/models`` and ``POST /s/<id>/v1/chat/completions``; an unknown session is a 404
    before any body is read."""

    def __init__(self, endpoint: AgentEndpoint) -> None:
        self.endpoint = endpoint

    @staticmethod
    def _session(path: str, tail: str) -> str | None:
        parts = path.split("/")  # "", "s", <id>, "v1", ...
        ok = len(parts) >= 4 and parts[1] == "s" and parts[3] == "v1" and "/".join(parts[4:]) == tail
        return parts[2] if ok else None

    def head(self, request: Request) -> Answer | None:
        tail = {"GET": "models", "POST": "chat/completions"}.get(request.method)
        if tail is None:
            return 405, error(f"method {request.method[:16]!r} not allowed")
        if not self.endpoint.known(self._session(request.path, tail)):
            return 404, error("not found", "not_found_error")
        if request.method == "GET":
            return 200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "gspo"}]}
        return None

    async def body(self, request: Request, body: bytes) -> Answer:
        return await self.endpoint.submit(cast(str, self._session(request.path, "chat/completions")), body)

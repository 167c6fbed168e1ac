"""`mcp` tools: the tools an MCP server lists (streamable HTTP, the official `mcp` SDK), one session per episode.

The SDK is asyncio: a toolbox's MCP servers share one event loop on a thread of its own
(:class:`EventLoopThread`); the toolbox's pool threads hand it their calls, so the calls of a batch run
concurrently there. Each episode gets its own MCP session on first use (the issue's "called per rollout
session": a server may keep per-session state), held by a task of its own (the SDK's task groups must be
entered and left in one task) and closed when the episode ends. Connections obey the egress policy
(`gspo_core.egress_async`).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gspo_core.agents.tools import HTTP_TRIES, Tool, ToolResult, ToolSpecError, endpoint
from gspo_core.agents.tools_schema import HTTP_TIMEOUT_S
from gspo_core.rewards.policy import GraderPolicy

FIELDS = {"type", "server_url", "headers", "allowed_tools", "timeout_s"}
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
#: The session a job start opens to list the tools (episodes use their own).
LISTING = -1
T = TypeVar("T")


class EventLoopThread:
    """One asyncio event loop running on a daemon thread of its own; :meth:`run` waits for a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass(frozen=True)
class McpSpec:
    """A validated ``{"type": "mcp", ...}`` entry."""

    url: str
    headers: dict[str, str]
    allowed: tuple[str, ...] | None
    timeout_s: float


def check_mcp_spec(spec: dict, path: str, policy: GraderPolicy) -> McpSpec:
    """The entry's fields, checked without contacting the server (the API's check at submit)."""
    url, headers = endpoint(spec, path, policy)
    allowed = spec.get("allowed_tools")
    if allowed is not None and (
        not isinstance(allowed, list)
        or not all(isinstance(n, str) and NAME.fullmatch(n) for n in allowed)
        or len(set(allowed)) != len(allowed)
    ):
        raise ToolSpecError(f"{path}.allowed_tools", "must be a list of distinct tool names")
    timeout = spec.get("timeout_s", 10.0)
    lo, hi = HTTP_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not lo <= timeout <= hi:
        raise ToolSpecError(f"{path}.timeout_s", f"must be a number of seconds between {lo:g} and {hi:g}")
    return McpSpec(url, dict(headers), None if allowed is None else tuple(allowed), float(timeout))


@dataclass
class _Held:
    """An episode's session: its task holds the SDK client open until ``stop`` is set."""

    ready: asyncio.Future
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


def _leaf(exc: BaseException) -> BaseException:
    """The first exception inside (anyio task groups wrap the transport's failures in groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _result_text(result: Any) -> str:
    """A call's content blocks as the model reads them: text as is, other blocks as JSON."""
    parts = [
        block.text if block.type == "text" else json.dumps(block.model_dump(mode="json", exclude_none=True))
        for block in result.content
    ]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content)]
    return "\n".join(parts)


class McpServer:
    """One MCP server of a job: lists its tools, and calls them in per-episode sessions on ``loop``."""

    def __init__(self, spec: McpSpec, policy: GraderPolicy, loop: EventLoopThread, backoff_s: float = 0.2) -> None:
        import httpx2

        from gspo_core.egress import EgressPolicy
        from gspo_core.egress_async import PinnedAsyncTransport

        self.spec, self.loop, self.backoff_s = spec, loop, backoff_s
        self.sessions: dict[int, _Held] = {}  # touched on the loop thread only
        self.opened = 0  # sessions opened so far (the listing's included)
        self.http = httpx2.AsyncClient(
            transport=PinnedAsyncTransport(EgressPolicy(policy.egress_allow)),
            headers=spec.headers,
            timeout=httpx2.Timeout(spec.timeout_s, read=max(spec.timeout_s, 300.0)),  # the SSE stream idles
            follow_redirects=False,
            trust_env=False,
        )

    def tools(self, path: str) -> list[Tool]:
        """The server's tools (those of ``allowed_tools``), as the model is offered them; ToolSpecError naming
        ``path`` when the server cannot be reached or lacks an allowed tool."""
        try:
            listed = self.loop.run(self._list())
        except Exception as exc:
            why = _leaf(exc)
            raise ToolSpecError(
                f"{path}.server_url",
                f"could not list the tools of the MCP server {self.spec.url}: {type(why).__name__}: {why}"[:500],
            ) from None
        by_name = {t.name: t for t in listed}
        allowed = self.spec.allowed if self.spec.allowed is not None else tuple(by_name)
        if missing := [name for name in allowed if name not in by_name]:
            raise ToolSpecError(f"{path}.allowed_tools", f"the MCP server lists no tool named {missing[0]!r}")
        return [self._tool(by_name[name]) for name in allowed]

    def _tool(self, listed: Any) -> Tool:
        params = dict(listed.input_schema or {"type": "object", "properties": {}})
        schema = {
            "type": "function",
            "function": {"name": listed.name, "description": listed.description or "", "parameters": params},
        }
        return Tool(
            listed.name,
            schema,
            tuple(params.get("properties") or {}),
            {},
            lambda arguments, episode: self.call(episode, listed.name, arguments),
        )

    def call(self, episode: int, name: str, arguments: dict) -> ToolResult:
        """One call in the episode's session. An ``isError`` result or a JSON-RPC error is shown to the model;
        a connection failure or a timeout is tried :data:`HTTP_TRIES` times (a new session each), then the
        rollout is dropped."""
        return self.loop.run(self._call(episode, name, arguments), HTTP_TRIES * (3 * self.spec.timeout_s + 5))

    async def _call(self, episode: int, name: str, arguments: dict) -> ToolResult:
        from mcp import MCPError

        from gspo_core.egress_async import EgressRefusedError

        last = ToolResult("", error="connection", drop=True)
        for attempt in range(HTTP_TRIES):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                client = await asyncio.wait_for(self._client(episode), self.spec.timeout_s)
                result = await asyncio.wait_for(client.call_tool(name, arguments), self.spec.timeout_s)
            except MCPError as exc:  # the server answered: a protocol-level error, told to the model
                return ToolResult(f"error: {exc}", error="mcp_error")
            except Exception as exc:
                why = _leaf(exc)
                if isinstance(why, EgressRefusedError):
                    return ToolResult(f"error: {why}", error="egress_refused", drop=True)
                kind = "timeout" if isinstance(why, TimeoutError) else "connection"
                last = ToolResult(f"error: {type(why).__name__}", error=kind, drop=True)
                await self._end([episode])  # the session may be broken: the next try opens a new one
                continue
            return ToolResult(_result_text(result), error="tool_error" if result.is_error else None)
        return last

    async def _client(self, episode: int) -> Any:
        held = self.sessions.get(episode)
        if held is None:
            held = self.sessions[episode] = _Held(asyncio.get_running_loop().create_future())
            held.task = asyncio.get_running_loop().create_task(self._hold(held))
        return await asyncio.shield(held.ready)  # one caller's timeout does not cancel the others' wait

    async def _hold(self, held: _Held) -> None:
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        transport = streamable_http_client(self.spec.url, http_client=self.http)
        self.opened += 1
        try:
            async with Client(transport, read_timeout_seconds=self.spec.timeout_s, cache=None) as client:
                held.ready.set_result(client)
                await held.stop.wait()
        except Exception as exc:  # failing to open is the callers' to handle; failing to close is no one's
            if not held.ready.done():
                held.ready.set_exception(exc)
        finally:
            if not held.ready.done():  # cancelled while opening
                held.ready.set_exception(ConnectionError("the MCP session was closed"))

    async def _list(self) -> list[Any]:
        try:
            client = await asyncio.wait_for(self._client(LISTING), self.spec.timeout_s)
            tools, cursor = [], None
            while True:
                page = await asyncio.wait_for(client.list_tools(cursor=cursor), self.spec.timeout_s)
                tools += page.tools
                if not (cursor := page.next_cursor):
                    return tools
        finally:
            await self._end([LISTING])

    async def _end(self, episodes: list[int]) -> None:
        held = [self.sessions.pop(e) for e in episodes if e in self.sessions]
        for h in held:
            h.stop.set()
        tasks = [h.task for h in held if h.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.spec.timeout_s)
            for task in late:
                task.cancel()

    def end(self, episodes: list[int]) -> None:
        """Close these episodes' sessions (those they opened)."""
        self.loop.run(self._end(list(episodes)), 2 * self.spec.timeout_s + 5)

    def close(self) -> None:
        async def close_all() -> None:
            await self._end(list(self.sessions))
            await self.http.aclose()

        self.loop.run(close_all(), 2 * self.spec.timeout_s + 5)

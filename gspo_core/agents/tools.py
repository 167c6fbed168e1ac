"""Tools a job offers the model: `python` (typed functions run in the grader sandbox), `http` (an endpoint with
OpenAI Agent RFT semantics) and `mcp` (`gspo_core.agents.mcp`), validated into one `Toolbox` that runs a batch's
calls at once."""

from __future__ import annotations

import ast
import json
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gspo_core.agents.formats import ToolCall
from gspo_core.agents.tools_schema import AGENT_TIMEOUT_S, HTTP_TIMEOUT_S
from gspo_core.rewards.base import GraderError, RewardSpecError
from gspo_core.rewards.isolation import REFUSED, SandboxLimits, isolation_for
from gspo_core.rewards.policy import DEFAULT_POLICY, GraderPolicy
from gspo_core.stopping import NEVER, StopCheck

if TYPE_CHECKING:
    from gspo_core.agents.mcp import EventLoopThread, McpServer

#: Characters of a tool's answer shown to the model; the rest is cut (a huge answer would eat the budget).
MAX_RESULT_CHARS = 8_000
MAX_TOOLS = 64
#: Attempts of an http tool call on a 5xx or timeout (Agent RFT: then the rollout is dropped).
HTTP_TRIES = 3
RETRY_STATUS = range(500, 600)
PY_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array", "dict": "object"}
DISPATCH = """

def __gspo_call__(__name, __kwargs):
    __out = globals()[__name](**__kwargs)
    if isinstance(__out, str):
        return __out
    try:
        import json as __json
        return __json.dumps(__out)
    except Exception:
        return str(__out)
"""


class ToolSpecError(RewardSpecError):
    """An invalid ``tools`` entry; ``field`` is its dotted path (``tools[0].source``)."""


@dataclass(frozen=True)
class ToolResult:
    """What a call gave the model: ``text``; ``error``: the kind of failure (None: it worked), counted as
    ``tool_errors/<tool>/<kind>``; ``drop``: the rollout cannot go on (Agent RFT: an http tool's 5xx or
    timeout after its retries) and is dropped from the update."""

    text: str
    error: str | None = None
    drop: bool = False


@dataclass(frozen=True)
class Tool:
    """One callable tool: its OpenAI function schema and how to call it (``run(arguments, episode) ->
    ToolResult``; ``episode`` keys the state a tool keeps per episode: an MCP session)."""

    name: str
    schema: dict
    params: tuple[str, ...]
    kinds: dict[str, str]
    run: Callable[[dict, int], ToolResult]
    close: Callable[[], None] | None = None


def _python_tools(spec: dict, path: str, policy: GraderPolicy) -> list[Tool]:
    source = spec.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ToolSpecError(f"{path}.source", "must be Python source defining typed functions")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ToolSpecError(f"{path}.source", f"syntax error line {exc.lineno}: {exc.msg}") from None
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    if not funcs:
        raise ToolSpecError(f"{path}.source", "defines no public top-level function")
    timeout = spec.get("timeout_s", 5.0)
    # Compared before any conversion: float() of a 400-digit integer raises.
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0.01 <= timeout <= policy.max_timeout_s
    ):
        raise ToolSpecError(f"{path}.timeout_s", f"must be a number between 0.01 and {policy.max_timeout_s:g}")
    if isolation_for(policy).mode == REFUSED:
        raise ToolSpecError(
            f"{path}.type", "python tools are not available on this server: it cannot isolate user code"
        )
    limits = SandboxLimits(timeout_s=float(timeout), memory_mb=min(512, policy.max_memory_mb), niceness=policy.niceness)
    code = source + DISPATCH
    return [_python_tool(fn, f"{path}.source", code, limits, policy) for fn in funcs]


def _python_tool(fn: ast.FunctionDef, where: str, code: str, limits: SandboxLimits, policy: GraderPolicy) -> Tool:
    from gspo_core.rewards.sandbox import run_sandboxed

    args = fn.args.args
    required = len(args) - len(fn.args.defaults)
    props: dict[str, dict] = {}
    kinds: dict[str, str] = {}
    for arg in args:
        kind = arg.annotation.id if isinstance(arg.annotation, ast.Name) else None
        if kind not in PY_TYPES:
            raise ToolSpecError(where, f"{fn.name}({arg.arg}): annotate it with one of {', '.join(PY_TYPES)}")
        props[arg.arg], kinds[arg.arg] = {"type": PY_TYPES[kind]}, kind
    doc = (ast.get_docstring(fn) or fn.name).strip().split("\n\n")[0]
    schema = {
        "type": "function",
        "function": {
            "name": fn.name,
            "description": doc,
            "parameters": {"type": "object", "properties": props, "required": [a.arg for a in args[:required]]},
        },
    }

    def run(arguments: dict, episode: int = 0) -> ToolResult:
        (out,) = run_sandboxed(code, [[fn.name, arguments]], limits, policy, entry="__gspo_call__")
        if isinstance(out, GraderError):
            return ToolResult(f"error: {out}", error=out.kind)
        return ToolResult(str(out))

    return Tool(fn.name, schema, tuple(a.arg for a in args), kinds, run)


def _http_tool(spec: dict, path: str, policy: GraderPolicy) -> Tool:
    import re

    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]{0,63}", name):
        raise ToolSpecError(f"{path}.name", "must be a name of letters, digits, _ or - (at most 64)")
    url, headers = endpoint(spec, path, policy)
    params = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolSpecError(f"{path}.parameters", 'must be a JSON schema of {"type": "object"}')
    description = spec.get("description", "")
    if not isinstance(description, str):
        raise ToolSpecError(f"{path}.description", "must be a string")
    timeout = spec.get("timeout_s", 10.0)
    lo, hi = HTTP_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not lo <= timeout <= hi:
        raise ToolSpecError(f"{path}.timeout_s", f"must be a number of seconds between {lo:g} and {hi:g}")
    caller = HttpToolCaller(url, float(timeout), headers, policy)
    schema = {"type": "function", "function": {"name": name, "description": description, "parameters": params}}
    props = params.get("properties") or {}
    return Tool(name, schema, tuple(props), {}, caller.call, caller.close)


def endpoint(spec: dict, path: str, policy: GraderPolicy) -> tuple[str, dict]:
    """``server_url`` (http(s), not refused by the egress policy) and ``headers`` of an http tool, an mcp
    server or an agent."""
    from gspo_core.egress import UserUrlError, check_user_url, header_refusal

    try:
        url = check_user_url(spec.get("server_url"), policy.egress_allow)
    except UserUrlError as exc:
        raise ToolSpecError(f"{path}.server_url", str(exc)) from None
    headers = spec.get("headers") or {}
    if not isinstance(headers, dict):
        raise ToolSpecError(f"{path}.headers", "must be an object of header names to values")
    for key, value in headers.items():
        if why := header_refusal(key, value):
            raise ToolSpecError(f"{path}.headers.{key}", why)
    return url, headers


def agent_spec(specs: object, policy: GraderPolicy = DEFAULT_POLICY) -> dict | None:
    """The job's bring-your-own-agent entry ``{"type": "agent", "server_url", "headers", "timeout_s"?}``
    validated (`gspo_core.agents.remote`), or None when ``tools`` has none. It comes alone: the agent runs
    its own tools."""
    if not isinstance(specs, list):
        return None
    at = [i for i, spec in enumerate(specs) if isinstance(spec, dict) and spec.get("type") == "agent"]
    if not at:
        return None
    if len(specs) > 1:
        other = next(i for i in range(len(specs)) if i != at[0])
        raise ToolSpecError(f"tools[{other}]", "an agent comes alone in tools: no other tools (it runs its own)")
    spec = specs[0]
    if extra := sorted(set(spec) - {"type", "server_url", "headers", "timeout_s"}):
        raise ToolSpecError(f"tools[0].{extra[0]}", "unknown field")
    endpoint(spec, "tools[0]", policy)
    timeout = spec.get("timeout_s", 300)
    lo, hi = AGENT_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not lo <= timeout <= hi:
        raise ToolSpecError("tools[0].timeout_s", f"must be a number of seconds between {lo:g} and {hi:g}")
    return spec


class HttpToolCaller:
    """POSTs a call's arguments to ``url`` (egress policy enforced) with OpenAI Agent RFT's rules: the body of
    a 2xx or a 4xx is the tool result (a 4xx counted as an ``http_4xx`` error); a 5xx or a timeout is tried
    :data:`HTTP_TRIES` times with backoff, then the rollout is dropped (``http_5xx`` / ``timeout``)."""

    def __init__(self, url: str, timeout: float, headers: dict, policy: GraderPolicy, backoff_s: float = 0.2) -> None:
        from gspo_core.egress import EgressPolicy
        from gspo_core.egress_client import EgressClient

        self.url, self.backoff_s = url, backoff_s
        self.client = EgressClient(EgressPolicy(policy.egress_allow), timeout, headers=headers)

    def call(self, arguments: dict, episode: int = 0) -> ToolResult:
        from gspo_core.egress import EgressRefused
        from gspo_core.egress_client import EgressError

        last = ToolResult("", error="http_error", drop=True)
        for attempt in range(HTTP_TRIES):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, body = self.client.request("POST", self.url, json=arguments)
            except EgressRefused as exc:
                return ToolResult(f"error: {exc}", error="egress_refused", drop=True)
            except EgressError as exc:
                last = ToolResult(
                    f"error: {exc}", error="timeout" if exc.kind == "timeout" else "http_error", drop=True
                )
                continue
            text = body.decode("utf-8", "replace")
            if status in RETRY_STATUS:
                last = ToolResult(f"error: HTTP {status}", error="http_5xx", drop=True)
                continue
            return ToolResult(text, error="http_4xx" if status >= 400 else None)
        return last

    def close(self) -> None:
        self.client.close()


KINDS: dict[str, Callable[[dict, str, GraderPolicy], list[Tool]]] = {
    "python": _python_tools,
    "http": lambda spec, path, policy: [_http_tool(spec, path, policy)],
}


class Toolbox:
    """A job's tools by name, their schemas (the chat template's ``tools=``), and the batch runner:
    :meth:`call_many` runs every call of a turn of the whole batch concurrently. ``servers`` (MCP) keep
    sessions per episode on ``loop``, the toolbox's event loop thread."""

    def __init__(
        self,
        tools: list[Tool],
        concurrency: int = 16,
        servers: Sequence[McpServer] = (),
        loop: EventLoopThread | None = None,
    ) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.schemas = [tool.schema for tool in tools]
        self.servers, self.loop = list(servers), loop
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="tools")

    def call(self, call: ToolCall, episode: int = 0, offered: frozenset[str] | None = None) -> ToolResult:
        """One call of ``episode``: an unknown tool (or one its row does not offer: ``offered``, None: all) or
        bad arguments are told to the model as the result."""
        if call.error:
            return ToolResult(f"error: {call.error}", error="bad_call")
        tool = self.tools.get(call.name) if offered is None or call.name in offered else None
        if tool is None:
            return ToolResult(f"error: no tool named {call.name!r}", error="unknown_tool")
        args = dict(call.arguments)
        if "_" in args and tool.params:  # the toy format's one positional value
            args = {tool.params[0]: _coerce(args.pop("_"), tool.kinds.get(tool.params[0]))}
        unknown = set(args) - set(tool.params) if tool.kinds else set()
        required = tool.schema["function"]["parameters"].get("required", [])
        missing = [name for name in required if name not in args]
        if unknown or missing:
            why = f"unknown arguments {sorted(unknown)}" if unknown else f"missing arguments {missing}"
            return ToolResult(f"error: {call.name}: {why}", error="bad_arguments")
        return tool.run(args, episode)

    def call_many(
        self,
        calls: list[ToolCall],
        episodes: list[int] | None = None,
        offered: list[frozenset[str] | None] | None = None,
        stop: StopCheck = NEVER,
    ) -> list[ToolResult]:
        """Every call at once (``episodes[i]``, ``offered[i]``: call i's episode and its row's tools); each
        result cut to :data:`MAX_RESULT_CHARS`. When ``stop`` says so, `StepStopped` is raised at once: the
        calls not started are cancelled, those in flight are left to their own timeouts."""
        futures = [
            self._pool.submit(self.call, call, episode, tools)
            for call, episode, tools in zip(
                calls, episodes or [0] * len(calls), offered or [None] * len(calls), strict=True
            )
        ]
        try:
            results = [stop.result(future, math.inf) for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return [replace(r, text=r.text[:MAX_RESULT_CHARS]) if len(r.text) > MAX_RESULT_CHARS else r for r in results]

    def end_episodes(self, episodes: list[int]) -> None:
        """These episodes are over: what tools keep for them (MCP sessions) is released."""
        for server in self.servers:
            server.end(episodes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for tool in self.tools.values():
            if tool.close is not None:
                tool.close()
        for server in self.servers:
            server.close()
        if self.loop is not None:
            self.loop.close()


def _coerce(value: Any, kind: str | None) -> Any:
    """A toy-format value (text) as its parameter's type, where it reads as one."""
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            out = float(value)
            return out if math.isfinite(out) else value
    except ValueError:
        pass
    return value


def build_toolbox(specs: object, policy: GraderPolicy = DEFAULT_POLICY, connect: bool = True) -> Toolbox | None:
    """Validate a job's ``tools`` (None or [] = no tools) and build its toolbox; raises :class:`ToolSpecError`
    naming the bad field. ``connect``: list the tools of ``mcp`` servers (a job's start; False: the API's
    check at submit, which checks their fields only and contacts no server)."""
    if specs is None or specs == []:
        return None
    if agent_spec(specs, policy) is not None:
        return None  # the agent is the environment: no toolbox
    if not isinstance(specs, list) or len(specs) > MAX_TOOLS:
        raise ToolSpecError("tools", f"must be a list of at most {MAX_TOOLS} tool objects")
    box = Toolbox([])
    try:
        for i, spec in enumerate(specs):
            for tool in _tools_of(spec, f"tools[{i}]", policy, box, connect):
                if tool.name in box.tools:
                    raise ToolSpecError(f"tools[{i}]", f"a second tool named {tool.name!r}")
                box.tools[tool.name] = tool
                box.schemas.append(tool.schema)
        json.dumps(box.schemas)  # schemas go into prompts: they must be plain JSON
    except BaseException:
        box.close()
        raise
    return box


def _tools_of(spec: object, path: str, policy: GraderPolicy, box: Toolbox, connect: bool) -> list[Tool]:
    """The tools of one entry; an ``mcp`` server joins ``box`` (its event loop started on the first)."""
    if not isinstance(spec, dict):
        raise ToolSpecError(path, "must be an object")
    kind = spec.get("type")
    if kind not in (*KINDS, "mcp"):
        raise ToolSpecError(f"{path}.type", f"must be one of {', '.join(KINDS)}, mcp, agent")
    if kind == "mcp":
        from gspo_core.agents.mcp import FIELDS as known
    else:
        known = {"python": {"type", "source", "timeout_s"}}.get(
            kind, {"type", "name", "description", "parameters", "server_url", "headers", "timeout_s"}
        )
    if extra := sorted(set(spec) - known):
        raise ToolSpecError(f"{path}.{extra[0]}", "unknown field")
    if kind != "mcp":
        return KINDS[kind](spec, path, policy)
    from gspo_core.agents.mcp import EventLoopThread, McpServer, check_mcp_spec

    checked = check_mcp_spec(spec, path, policy)
    if not connect:
        return []
    box.loop = box.loop or EventLoopThread()
    server = McpServer(checked, policy, box.loop)
    box.servers.append(server)
    return server.tools(path)

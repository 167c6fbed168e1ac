"""OpenEnv's wire protocol, spoken by our own client: a WebSocket session at ``/ws`` (``reset``/``step``/``close``
messages, ``observation``/``error`` answers) or HTTP ``POST /reset`` and ``/step``, every connection made to an
address the egress policy checked (the WebSocket's socket is opened here, to the pinned address)."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from gspo_core.egress import EgressPolicy, EgressRefused
from gspo_core.egress_client import EgressClient, EgressError

#: Bytes one answer (an observation) may hold.
MAX_MESSAGE_BYTES = 1 << 20


class OpenEnvError(Exception):
    """The server failed the episode: ``kind`` (counted as ``openenv_errors/<kind>``) and a message safe to show
    (no remote body beyond the server's own error text, cut short)."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message[:500])


@dataclass(frozen=True)
class StepResult:
    """One answer of the server: the observation's fields, its reward (None: none given) and ``done``."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


def parse_result(data: object) -> StepResult:
    """OpenEnv's serialized observation ``{"observation": {...}, "reward": float | null, "done": bool}``."""
    if not isinstance(data, dict) or not isinstance(data.get("observation"), dict):
        raise OpenEnvError("invalid_answer", "the answer has no observation object")
    reward = data.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise OpenEnvError("invalid_answer", "the answer's reward is not a number")
    if reward is not None and not float("-inf") < float(reward) < float("inf"):
        raise OpenEnvError("invalid_answer", "the answer's reward is not finite")
    return StepResult(data["observation"], None if reward is None else float(reward), bool(data.get("done")))


class Session(Protocol):
    """One episode's session with the server."""

    def reset(self, seed: int) -> StepResult: ...

    def step(self, action: dict[str, Any]) -> StepResult: ...

    def close(self) -> None: ...


def pinned_socket(policy: EgressPolicy, host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to the first of ``host``'s addresses that the policy allows and that answers; raises
    :class:`EgressRefused` when it allows none (nothing is connected to then)."""
    addresses = policy.checked_addresses(host, port)
    for address in addresses:
        try:
            return socket.create_connection((address, port), timeout=timeout)
        except OSError:
            continue
    raise OpenEnvError("connect_error", f"could not connect to {host}:{port}")


class WebSocketSession:
    """A session at ``<url>/ws``: one server-side environment for the connection's life."""

    def __init__(self, url: str, headers: dict[str, str], policy: EgressPolicy, timeout: float) -> None:
        from websockets.exceptions import InvalidHandshake, WebSocketException
        from websockets.sync.client import connect

        parts = urlsplit(url)
        secure = parts.scheme == "https"
        ws_url = urlunsplit(("wss" if secure else "ws", parts.netloc, parts.path.rstrip("/") + "/ws", "", ""))
        host, port = parts.hostname or "", parts.port or (443 if secure else 80)
        self.timeout = timeout
        try:
            sock = pinned_socket(policy, host, port, timeout)
        except EgressRefused:
            raise
        except OSError as exc:
            raise OpenEnvError("connect_error", f"could not connect to {host}:{port}") from exc
        try:
            self.ws = connect(
                ws_url,
                sock=sock,
                ssl=ssl.create_default_context() if secure else None,
                server_hostname=host if secure else None,
                additional_headers=headers,
                open_timeout=timeout,
                close_timeout=min(timeout, 5.0),
                max_size=MAX_MESSAGE_BYTES,
                proxy=None,
            )
        except (InvalidHandshake, WebSocketException, OSError, TimeoutError) as exc:
            sock.close()
            why = f"no WebSocket session at {parts.netloc}/ws ({type(exc).__name__})"
            raise OpenEnvError("connect_error", why) from None

    def _ask(self, message: dict[str, Any]) -> StepResult:
        from websockets.exceptions import ConnectionClosed, WebSocketException

        try:
            self.ws.send(json.dumps(message))
            raw = self.ws.recv(timeout=self.timeout)
        except TimeoutError:
            raise OpenEnvError("timeout", f"no answer within {self.timeout:g} s") from None
        except ConnectionClosed:
            raise OpenEnvError("connection_closed", "the server closed the session") from None
        except (WebSocketException, OSError) as exc:
            raise OpenEnvError("connection_error", f"the session broke ({type(exc).__name__})") from None
        try:
            answer = json.loads(raw)
        except (ValueError, TypeError):
            raise OpenEnvError("invalid_answer", "the answer is not JSON") from None
        if not isinstance(answer, dict):
            raise OpenEnvError("invalid_answer", "the answer is not an object")
        if answer.get("type") == "error":
            data = answer["data"] if isinstance(answer.get("data"), dict) else {}
            raise OpenEnvError("server_error", f"{data.get('code', 'error')}: {data.get('message', '')}")
        if answer.get("type") != "observation":
            raise OpenEnvError("invalid_answer", f"unexpected answer type {str(answer.get('type'))[:50]!r}")
        return parse_result(answer.get("data"))

    def reset(self, seed: int) -> StepResult:
        return self._ask({"type": "reset", "data": {"seed": seed}})

    def step(self, action: dict[str, Any]) -> StepResult:
        return self._ask({"type": "step", "data": action})

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a session that already broke has nothing to close politely
            self.ws.send(json.dumps({"type": "close"}))
        self.ws.close()


class HttpSession:
    """``POST <url>/reset`` and ``<url>/step`` through the egress client: for a server that keeps one
    episode's state between HTTP calls (openenv's own HTTP routes make a fresh environment per call)."""

    def __init__(self, url: str, headers: dict[str, str], policy: EgressPolicy, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.client = EgressClient(policy, timeout, headers, max_body=MAX_MESSAGE_BYTES, max_connections=1)

    def _post(self, path: str, body: dict[str, Any]) -> StepResult:
        try:
            status, raw = self.client.request("POST", f"{self.url}{path}", json=body)
        except EgressError as exc:
            raise OpenEnvError("timeout" if exc.kind == "timeout" else "connection_error", str(exc)) from None
        if status >= 300:
            raise OpenEnvError(f"http_{status // 100}xx", f"{path}: HTTP {status}")
        try:
            return parse_result(json.loads(raw))
        except ValueError:
            raise OpenEnvError("invalid_answer", "the answer is not JSON") from None

    def reset(self, seed: int) -> StepResult:
        return self._post("/reset", {"seed": seed})

    def step(self, action: dict[str, Any]) -> StepResult:
        return self._post("/step", {"action": action})

    def close(self) -> None:
        self.client.close()

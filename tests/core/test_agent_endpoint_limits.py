"""The agent endpoint under a hostile client on real sockets: bodies are bounded and read only for a session,
a request must arrive whole within its deadline, and slow sockets can neither take a thread each nor lock an
agent out."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gspo_core.agents import pick_format
from gspo_core.agents.bounded_http import Limits
from gspo_core.agents.remote import AgentEndpoint
from gspo_core.rollout.base import SamplingSpec
from tests.conftest import grader_policy


class ScriptedAgent:
    """An agent server whose agent is ``script(endpoint's base URL for the session, session id)``: what it
    returns is kept in ``results`` (an exception too, raised again by :meth:`check`)."""

    def __init__(self, script: Callable[[str, str], object]) -> None:
        self.results: list[object] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    outer.results.append(script(body["base_url"], body["session"]))
                except BaseException as exc:  # the test's assertion, for the test's thread
                    outer.results.append(exc)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.spec = {
            "type": "agent",
            "server_url": f"http://127.0.0.1:{self.httpd.server_address[1]}/",
            "timeout_s": 60,
        }

    def check(self) -> list[object]:
        for result in self.results:
            if isinstance(result, BaseException):
                raise result
        return self.results

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def run_session(tokenizer, script: Callable[[AgentEndpoint, str, str], object], limits: Limits) -> object:
    """One rollout of one session on a fresh endpoint with ``limits``, its agent ``script(endpoint, base URL,
    session)``; what the script returned."""
    holder: dict[str, AgentEndpoint] = {}
    agent = ScriptedAgent(lambda base, sid: script(holder["endpoint"], base, sid))
    endpoint = holder["endpoint"] = AgentEndpoint(
        agent.spec, grader_policy(egress_allow=("127.0.0.1",)), pick_format("toy", None), 64, limits=limits
    )
    try:
        env = endpoint.environment(tokenizer, [{}])
        env.close(env.open([[1]], SamplingSpec(n=1, max_tokens=8)))
        (result,) = agent.check()
        return result
    finally:
        endpoint.close()
        agent.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from gspo_core.toy import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split("/")[0].split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def exchange(sock: socket.socket, data: bytes, wait_s: float = 5.0) -> tuple[int, bytes]:
    """Send ``data``, read until the server closes (or ``wait_s``): the status and what came."""
    sock.sendall(data)
    sock.settimeout(wait_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        pass
    return (int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.") else 0), got


def post_head(path: str, length: str | None) -> bytes:
    size = "" if length is None else f"Content-Length: {length}\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{size}\r\n".encode()


def test_a_body_is_read_only_for_a_session_and_only_up_to_its_bound(tokenizer):
    """An unknown session is a 404 before a byte of its body is read (`Content-Length: -1` made the endpoint
    read to the end of the stream before it answered), and the stream is then closed: 200 MiB more cannot be
    sent. A session's request without a usable length is a 4xx without a read."""

    def script(endpoint, base, sid):
        chat = f"/s/{sid}/v1/chat/completions"
        answers = {}
        for name, head in [
            ("unknown", post_head("/s/nope/v1/chat/completions", "-1")),
            ("negative", post_head(chat, "-1")),
            ("missing", post_head(chat, None)),
            ("not_a_number", post_head(chat, "1e3")),
            ("too_large", post_head(chat, str(2048 + 1))),
            ("huge", post_head(chat, "9" * 40)),
            ("chunked", post_head(chat, None).replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n")),
        ]:
            with connect(base) as sock:
                status, got = exchange(sock, head, wait_s=3)
                answers[name] = (status, b"Connection: close" in got, sent_until_refused(sock, 200 << 20) < 64 << 20)
        with connect(base) as sock:  # within the bound: read, and checked as a chat request
            body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode()
            head = post_head(chat, str(len(body))).replace(b"Host", b"Connection: close\r\nHost")
            status, got = exchange(sock, head + body)
            answers["checked"] = (status, json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["message"])
        return answers

    answers = run_session(tokenizer, script, Limits(max_body=2048))
    refused = {"unknown": 404, "negative": 400, "missing": 411, "not_a_number": 400, "too_large": 413, "huge": 413}
    assert answers == {
        **{name: (status, True, True) for name, status in refused.items()},
        "chunked": (411, True, True),
        "checked": (400, 'messages[0].content[0]: only text parts are supported ({"type": "text", "text": "..."})'),
    }


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the readable ``sock`` was closed by the other end (a reset, when it sent after the close)."""
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def sent_until_refused(sock: socket.socket, most: int) -> int:
    """How much of ``most`` bytes could be sent before the peer's close stopped it."""
    sent, chunk = 0, b"x" * (1 << 20)
    sock.settimeout(5)
    try:
        while sent < most:
            sent += sock.send(chunk)
    except OSError:
        pass
    return sent


def test_a_slow_request_is_closed_at_its_deadline_however_it_trickles(tokenizer):
    """A byte every 0.2 s keeps each read short, but the whole request has 1 s: then 408 and the close."""

    def script(endpoint, base, sid):
        with connect(base) as sock:
            sock.settimeout(0.2)
            start, got = time.monotonic(), b""
            for byte in post_head(f"/s/{sid}/v1/chat/completions", "100"):
                if time.monotonic() - start > 5:
                    break
                sock.sendall(bytes([byte]))
                try:
                    got = sock.recv(4096)
                    break  # an answer, or the close
                except TimeoutError:
                    continue
            took = time.monotonic() - start
            _, rest = exchange(sock, b"", wait_s=2)
            return (got + rest).split(b"\r\n", 1)[0], took

    status_line, took = run_session(tokenizer, script, Limits(request_deadline_s=1.0))
    # The server's clock starts at its accept, a little before the client's `start` (0.998 s seen under load).
    assert status_line == b"HTTP/1.1 408 Request Timeout" and 0.9 <= took < 4.0, (status_line, took)


@pytest.mark.parametrize("limits", [Limits(max_connections=16), Limits(max_connections_total=16)], ids=["job", "all"])
def test_slow_sockets_take_no_thread_each_and_cannot_lock_an_agent_out(tokenizer, limits):
    """60 sockets that each sent part of a head, against a cap of 16 connections (of the job, of every job
    in the process): the endpoint keeps at most 16 open, spends no thread on them, and answers an agent's
    request at once (the oldest sockets still sending give way)."""

    def script(endpoint, base, sid):
        threads = threading.active_count()
        slow = [connect(base) for _ in range(60)]
        for sock in slow:
            with contextlib.suppress(ConnectionError):  # already dropped for a newer one
                sock.sendall(b"GET /s/")
        time.sleep(0.5)
        held, grew = len(endpoint.server.connections), threading.active_count() - threads
        with connect(base) as sock:
            start = time.monotonic()
            status, _ = exchange(sock, f"GET /s/{sid}/v1/models HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
            served_in = time.monotonic() - start
        readable, _, _ = select.select(slow, [], [], 0.5)
        closed = sum(1 for sock in readable if closed_by_peer(sock))
        for sock in slow:
            sock.close()
        return held, grew, status, served_in, closed

    held, grew, status, served_in, closed = run_session(tokenizer, script, limits)
    assert held <= 16 and grew <= 2, (held, grew)
    assert status == 200 and served_in < 3.0, (status, served_in)
    assert closed >= 60 - 16, closed  # dropped for newer ones

"""A user's agent server on loopback for worker tests: each rollout asks the service's chat endpoint once and
reports a reward; once ``slow`` is set, it first holds the rollout, as a slow agent (or its slow tool) does."""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class SlowAgent:
    """``held``: rollouts held so far (the step waiting on them is in flight)."""

    def __init__(self) -> None:
        self.slow, self.release = threading.Event(), threading.Event()
        self.held = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def spec(self, timeout_s: int = 600) -> dict:
        return {
            "type": "agent",
            "server_url": f"http://127.0.0.1:{self.httpd.server_address[1]}/",
            "timeout_s": timeout_s,
        }

    def _rollout(self, body: dict) -> None:
        if self.slow.is_set():
            with self._lock:
                self.held += 1
            self.release.wait(900)
        request = {"messages": [{"role": "user", "content": "say a:"}], "max_tokens": 4}
        post = urllib.request.Request(
            f"{body['base_url']}/chat/completions",
            data=json.dumps(request).encode(),
            headers={"Content-Type": "application/json"},
        )
        with contextlib.suppress(OSError):  # the episode is over (the service stopped waiting): nothing to say
            urllib.request.urlopen(post, timeout=60).read()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                agent._rollout(body)
                data = json.dumps({"reward": 1.0}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        return Handler

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

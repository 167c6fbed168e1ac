"""A real HTTP receiver of webhooks on loopback: records each request, answers scripted status codes."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """``answers``: the status of each request in turn (the last one repeats); ``hits``: (headers, body) of
    each request received; ``delay``: seconds each answer takes; ``most_at_once``: the most requests it was
    answering at the same time."""

    def __init__(self, answers: tuple[int, ...] = (200,), delay: float = 0.0) -> None:
        self.answers, self.hits = list(answers), []
        self.at_once = self.most_at_once = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                code = outer.answers[min(len(outer.hits), len(outer.answers) - 1)]
                with lock:
                    outer.hits.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    outer.at_once += 1
                    outer.most_at_once = max(outer.most_at_once, outer.at_once)
                time.sleep(delay)
                with lock:
                    outer.at_once -= 1
                text = b"secret remote details"  # must never reach the tenant
                self.send_response(code)
                self.send_header("content-length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, name="webhook-receiver", daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

"""The app served by a real uvicorn server on loopback, in a thread of the test process (so that a
test can read the app's state, e.g. its connection pool, while real HTTP clients hold streams)."""

from __future__ import annotations

import threading
import time

import uvicorn


class LiveServer:
    def __init__(self, app) -> None:
        self.app = app
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=2)
        )
        self.thread = threading.Thread(target=self.server.run, name="live-server", daemon=True)
        self.url = ""

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

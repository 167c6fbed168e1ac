"""A real MCP server for tests: the `mcp` SDK's own `MCPServer`, streamable HTTP on a free loopback port."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn
from mcp.server.mcpserver import MCPServer


class McpToolServer:
    """Tools ``f(key)`` (``key * 3``), ``g()``, ``slow()`` (0.5 s) and ``boom()`` (raises: an ``isError``
    result); ``calls``
    records every call as ``(tool, arguments)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        mcp = MCPServer("gspo-test", log_level="WARNING")

        @mcp.tool()
        def f(key: str) -> str:
            """Look a key up."""
            self.calls.append(("f", {"key": key}))
            return key * 3

        @mcp.tool()
        def g() -> str:
            """Not offered when allowed_tools leaves it out."""
            self.calls.append(("g", {}))
            return "g"

        @mcp.tool()
        async def slow() -> str:
            """Answers after 0.5 s."""
            self.calls.append(("slow", {}))
            await asyncio.sleep(0.5)
            return "late"

        @mcp.tool()
        def boom() -> str:
            """Always fails."""
            self.calls.append(("boom", {}))
            raise ValueError("boom")

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/mcp"
        config = uvicorn.Config(mcp.streamable_http_app(), log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def spec(self, **extra) -> dict:
        return {"type": "mcp", "server_url": self.url, "timeout_s": 5, **extra}

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

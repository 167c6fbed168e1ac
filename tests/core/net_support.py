"""Real loopback servers for the egress tests: a bare listener counting connections, an HTTP(S) server."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Listener:
    """A bare TCP listener that counts the connections it accepts (and closes them at once)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.port, self.accepted = self.sock.getsockname()[1], 0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


class Server:
    """A real HTTP(S) server on ``host``; ``routes`` maps a path to (status, headers, body); it records
    every request (path, headers, body) and, for HTTPS, the SNI name the client sent."""

    def __init__(self, host: str, routes: dict, tls: ssl.SSLContext | None = None) -> None:
        self.requests, self.sni = [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                outer.requests.append((self.path, dict(self.headers), self.rfile.read(n)))
                status, headers, body = routes.get(self.path, (200, {}, b'{"reward": 0.5}'))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v.replace("{port}", str(outer.port)))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET = _any

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        if tls is not None:
            tls.sni_callback = lambda sock, name, ctx: self.sni.append(name)
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def loopback_name() -> tuple[str, str]:
    """A name (not a literal, not 'localhost') that resolves to an address of this machine:
    its host name (/etc/hosts)."""
    name = socket.gethostname()
    addr = socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)[0][4][0]
    assert not ipaddress.ip_address(addr).is_global, f"{name} resolves to public {addr}"
    return name, addr

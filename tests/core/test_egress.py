"""Graders' outbound requests obey the egress policy: internal targets are refused without a connection
being made, connections are pinned to the checked address (TLS still verifies the name), redirects are
re-checked, credentials stay with their origin, and error texts carry no remote body or port state."""

from __future__ import annotations

import datetime
import json
import socket
import ssl

import pytest

from gspo_core.egress import EgressPolicy, EgressRefused
from gspo_core.egress_client import EgressClient, EgressError
from gspo_core.rewards import GraderPolicy, RewardSpecError, build_reward
from gspo_core.urls import redact_userinfo
from tests.core.net_support import Listener, Server, loopback_name


def sample(text: str) -> dict:
    return {"output_text": text, "output_tokens": len(text), "finish_reason": "stop"}


DEFAULT_POLICY = GraderPolicy()  # frozen: one instance serves every call


def score(spec, policy=DEFAULT_POLICY, text="abcd"):
    fn = build_reward(spec, policy)
    try:
        return fn.score_batch([{}], [sample(text)])[0]
    finally:
        fn.close()


@pytest.fixture()
def listener():
    lst = Listener()
    yield lst
    lst.close()


def _policy(*allow: str) -> GraderPolicy:
    return GraderPolicy(egress_allow=allow)


LOOPBACK_SPELLINGS = [
    "127.0.0.1",
    "localhost",
    "localhost.",
    "LocalHost",
    "127.1",
    "127.0.1",
    "2130706433",
    "0x7f000001",
    "0x7f.0.0.1",
    "0x7f.1",
    "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]",
    "[::127.0.0.1]",
    "[64:ff9b::7f00:1]",
    "[2002:7f00:1::]",
    "[::ffff:0:7f00:1]",
    "0",
    "0.0.0.0",
    "a.localhost",
]
OTHER_REFUSED = [
    "[::1]",
    "[::]",
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "100.64.0.1",
    "169.254.169.254",
    "169.254.170.2",
    "[fd00:ec2::254]",
    "168.63.129.16",
    "100.100.100.200",
    "[fe80::1]",
    "[fc00::1]",
    "224.0.0.1",
    "240.0.0.1",
    "255.255.255.255",
    "198.18.0.1",
    "[::ffff:10.0.0.1]",
    "[::ffff:169.254.169.254]",
    "[fe80::1%25eth0]",
]


@pytest.mark.parametrize("host", LOOPBACK_SPELLINGS + OTHER_REFUSED)
def test_internal_literal_urls_are_spec_errors_and_never_connected(listener, host):
    url = f"http://{host}:{listener.port}"
    for spec, field in (
        ({"type": "http", "url": url + "/score"}, "url"),
        (
            {"type": "score_model", "base_url": url + "/v1", "model": "m", "input": [{"role": "user", "content": "x"}]},
            "base_url",
        ),
        ({"type": "multi", "graders": {"h": {"type": "http", "url": url}}}, "graders.h.url"),
    ):
        with pytest.raises(RewardSpecError) as exc:
            build_reward(spec)
        assert exc.value.field == field and "not reachable" in exc.value.message
    client = EgressClient(EgressPolicy(), timeout=2)
    try:
        with pytest.raises(EgressRefused):  # the same check when such a URL is reached at run time
            client.request("POST", url + "/score", json={})
    finally:
        client.close()
    assert listener.accepted == 0


def test_a_name_that_resolves_inside_is_refused_at_run_time_without_connecting():
    name, addr = loopback_name()
    lst = Listener(addr)
    try:
        spec = {"type": "http", "name": "h", "url": f"http://{name}:{lst.port}/score", "retries": 2}
        r = score(spec)
        assert r.reward == 0.0 and r.errors["h"].startswith("egress_refused:"), r.errors
        assert "loopback" in r.errors["h"] or "private" in r.errors["h"]
        assert lst.accepted == 0
        judge = {
            "type": "score_model",
            "name": "j",
            "base_url": f"http://{name.upper()}:{lst.port}/v1",
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
            "api_key": "sk",
        }
        assert score(judge).errors["j"].startswith("egress_refused:") and lst.accepted == 0
        # the operator's allow-list opens it, by name or by address
        srv = Server(addr, {})
        try:
            for allow in (name, addr, f"{addr}/8" if ":" not in addr else f"{addr}/64"):
                ok = score({**spec, "url": f"http://{name}:{srv.port}/score"}, _policy(allow))
                assert ok.reward == 0.5 and not ok.errors, (allow, ok.errors)
        finally:
            srv.close()
    finally:
        lst.close()


def test_allow_list_opens_only_what_it_names(listener):
    assert (
        score(
            {"type": "http", "name": "h", "url": f"http://127.0.0.1:{listener.port}/", "retries": 0},
            _policy("127.0.0.1"),
        )
        .errors["h"]
        .startswith("http_error")
    )  # allowed: connected (a bare socket)
    assert listener.accepted == 1
    with pytest.raises(RewardSpecError):
        build_reward({"type": "http", "url": f"http://127.0.0.2:{listener.port}/"}, _policy("127.0.0.1"))
    with pytest.raises(RewardSpecError):  # a CIDR never opens a metadata address, only the address itself
        build_reward({"type": "http", "url": "http://169.254.169.254/"}, _policy("169.254.0.0/16"))
    build_reward({"type": "http", "url": "http://169.254.169.254/"}, _policy("169.254.169.254")).close()


def test_redirect_to_a_refused_host_is_refused_without_connecting(listener):
    name, _ = loopback_name()
    routes = {
        "/lit": (307, {"Location": f"http://127.0.0.1:{listener.port}/x"}, b""),
        "/name": (302, {"Location": f"http://{name}:{listener.port}/x"}, b""),
        "/meta": (301, {"Location": "http://169.254.169.254/latest/meta-data/"}, b""),
        "/file": (302, {"Location": "file:///etc/passwd"}, b""),
        "/loop": (302, {"Location": "/loop"}, b""),
    }
    srv = Server("127.0.0.2", routes)
    try:
        base = f"http://127.0.0.2:{srv.port}"
        for path in ("/lit", "/name", "/meta"):
            r = score({"type": "http", "name": "h", "url": base + path}, _policy("127.0.0.2"))
            assert r.errors["h"].startswith("egress_refused:"), (path, r.errors)
        r = score({"type": "http", "name": "h", "url": base + "/file", "retries": 0}, _policy("127.0.0.2"))
        assert r.errors["h"].startswith("http_error") and "passwd" not in r.errors["h"]
        srv.requests.clear()
        r = score({"type": "http", "name": "h", "url": base + "/loop", "retries": 0}, _policy("127.0.0.2"))
        assert r.errors["h"].startswith("http_error") and "redirected more than" in r.errors["h"]
        assert len(srv.requests) == 4  # the first request and at most 3 redirects
    finally:
        srv.close()
    assert listener.accepted == 0


def test_credentials_and_tenant_headers_stay_with_their_origin():
    b = Server("127.0.0.3", {})
    a = Server(
        "127.0.0.2",
        {
            "/away": (307, {"Location": f"http://127.0.0.3:{b.port}/score"}, b""),
            "/here": (308, {"Location": "/score"}, b""),
        },
    )
    try:
        spec = {"type": "http", "name": "h", "headers": {"Authorization": "Bearer tenant-secret", "X-Token": "t"}}
        policy = _policy("127.0.0.2", "127.0.0.3")
        r = score({**spec, "url": f"http://127.0.0.2:{a.port}/here"}, policy)
        assert r.reward == 0.5 and not r.errors
        assert [h.get("Authorization") for _, h, _ in a.requests] == ["Bearer tenant-secret"] * 2  # same origin
        r = score({**spec, "url": f"http://127.0.0.2:{a.port}/away"}, policy)
        assert r.reward == 0.5 and not r.errors
        path, headers, body = b.requests[-1]
        assert path == "/score" and json.loads(body)["sample"]["output_text"] == "abcd"  # 307 keeps the POST
        assert "Authorization" not in headers and "X-Token" not in headers
        assert headers["Host"] == f"127.0.0.3:{b.port}"
    finally:
        a.close()
        b.close()


class Resolver:
    """A name service for names the system cannot resolve (``*.test``): answers in turn, records calls."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers, self.calls = list(answers), []

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        return self.answers[min(len(self.calls), len(self.answers)) - 1]


def test_connection_is_pinned_to_the_checked_address(listener):
    srv = Server("127.0.0.2", {})
    policy = EgressPolicy(["127.0.0.2"])
    try:
        # The name exists only in this resolver: the request can only succeed by connecting to the
        # address that was checked, and the Host header still carries the name.
        rebind = Resolver(["127.0.0.2"], ["127.0.0.1"])
        client = EgressClient(policy, timeout=5, resolver=rebind)
        status, body = client.request("POST", f"http://pinned.test:{srv.port}/score", json={"a": 1})
        assert (status, json.loads(body)) == (200, {"reward": 0.5}) and rebind.calls == ["pinned.test"]
        assert srv.requests[-1][1]["Host"] == f"pinned.test:{srv.port}"
        client.close()
        # A second connection resolves again; the new answer is checked again and refused.
        client = EgressClient(policy, timeout=5, resolver=rebind)
        with pytest.raises(EgressRefused):
            client.request("POST", f"http://pinned.test:{listener.port}/score", json={})
        client.close()
        # Of a mixed answer only the allowed addresses are tried.
        mixed = Resolver(["127.0.0.1", "127.0.0.2"])
        client = EgressClient(policy, timeout=5, resolver=mixed)
        assert client.request("GET", f"http://mixed.test:{srv.port}/")[0] == 200
        client.close()
    finally:
        srv.close()
    assert listener.accepted == 0


def _tls_pair(tmp_path, name: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A throw-away CA and a server certificate for ``name``: (server context, client context)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM)  # noqa: E731
    (tmp_path / "cert.pem").write_bytes(pem(cert) + pem(ca))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client = ssl.create_default_context(cadata=pem(ca).decode())
    return server, client


def test_tls_verifies_the_name_while_connecting_to_the_pinned_address(tmp_path):
    server_ctx, client_ctx = _tls_pair(tmp_path, "judge.test")
    srv = Server("127.0.0.2", {}, tls=server_ctx)
    policy = EgressPolicy(["127.0.0.2"])
    try:
        client = EgressClient(policy, timeout=5, verify=client_ctx, resolver=Resolver(["127.0.0.2"]))
        assert client.request("POST", f"https://judge.test:{srv.port}/score", json={})[0] == 200
        assert srv.sni == ["judge.test"]
        with pytest.raises(EgressError) as exc:  # same address, another name: the certificate does not match
            client.request("POST", f"https://other.test:{srv.port}/score", json={})
        assert exc.value.kind == "http_error"
        client.close()
    finally:
        srv.close()


def test_error_texts_carry_no_remote_body_and_no_port_state(listener):
    secret = b"SECRET-internal-detail"
    chat = {"choices": [{"message": {"content": "SECRET-internal-detail"}}]}
    srv = Server(
        "127.0.0.1",
        {
            "/400": (400, {}, secret),
            "/500": (500, {}, secret),
            "/html": (200, {}, secret),
            "/v1/chat/completions": (200, {}, json.dumps(chat).encode()),
        },
    )
    local = _policy("127.0.0.1")
    try:
        base = f"http://127.0.0.1:{srv.port}"
        errors = [
            score({"type": "http", "name": "h", "url": base + p, "retries": 0}, local).errors["h"]
            for p in ("/400", "/500", "/html")
        ]
        errors.append(
            score(
                {
                    "type": "score_model",
                    "name": "h",
                    "base_url": base + "/v1",
                    "model": "m",
                    "input": [{"role": "user", "content": "x"}],
                },
                local,
            ).errors["h"]
        )
        assert errors[0].startswith("http_error") and "400" in errors[0] and "500" in errors[1]
        assert all("SECRET" not in e for e in errors), errors
    finally:
        srv.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there: connection refused
    texts = [
        score({"type": "http", "name": "h", "url": f"http://127.0.0.1:{port}/x", "retries": 0}, local)
        .errors["h"]
        .replace(str(port), "PORT")
        for port in (closed_port, listener.port)
    ]
    assert texts[0] == texts[1] == "http_error: could not get an answer from http://127.0.0.1:PORT", texts


@pytest.mark.parametrize(
    "header",
    ["Host", "content-length", "Transfer-Encoding", "Connection", "Proxy-Authorization", "X-Forwarded-For", "Bad Name"],
)
def test_routing_headers_are_refused_naming_the_field(header):
    with pytest.raises(RewardSpecError) as exc:
        build_reward({"type": "http", "url": "https://rm.example/score", "headers": {header: "x"}})
    assert exc.value.field == f"headers.{header}"


def test_header_values_and_api_keys_cannot_inject_lines():
    with pytest.raises(RewardSpecError) as exc:
        build_reward({"type": "http", "url": "https://rm.example/score", "headers": {"X-A": "a\r\nHost: evil"}})
    assert exc.value.field == "headers.X-A"
    with pytest.raises(RewardSpecError) as exc:
        build_reward(
            {
                "type": "score_model",
                "base_url": "https://j.example/v1",
                "model": "m",
                "api_key": "k\nX: y",
                "input": [{"role": "user", "content": "x"}],
            }
        )
    assert exc.value.field == "api_key"
    build_reward(
        {"type": "http", "url": "https://rm.example/score", "headers": {"Authorization": "Bearer t", "X-Api-Key": "k"}}
    ).close()


@pytest.mark.parametrize(
    "text,shown",
    [
        ("https://user:pass@host/x", "https://[redacted]@host/x"),
        ("http://u:p@ss@h:80/p?q=a@b", "http://[redacted]@h:80/p?q=a@b"),  # an unencoded @ in the password
        (
            "HTTP 500 from https://tok@h/a and mcp+http://x@y",
            "HTTP 500 from https://[redacted]@h/a and mcp+http://[redacted]@y",
        ),
        ("https://host/a@b?c=d@e#f@g", "https://host/a@b?c=d@e#f@g"),  # no userinfo: unchanged
        ("mailto:a@b.c, user@example.com", "mailto:a@b.c, user@example.com"),
    ],
)
def test_url_userinfo_is_redacted_in_any_text(text, shown):
    assert redact_userinfo(text) == shown

"""The Host header check (``--allowed-hosts``): a page a browser loaded from a name that
resolves to 127.0.0.1 (DNS rebinding) cannot reach a keyless loopback server, on any route,
/health included; a server bound to a loopback address allows only loopback names by
default, one bound to another address any host unless told otherwise."""

from __future__ import annotations

import http.client
import json
import socket

import httpx
import pytest

from kvwise.cli import build_parser
from kvwise.server import create_app
from kvwise.server.serving import DrainingServer
from kvwise.server.transport import LOOPBACK_HOSTS, allowed_hosts_for, parse_allowed_hosts
from tests.fakes import fake_engine

from .conftest import LiveServer


@pytest.fixture(scope="module")
def loopback_server():
    app = create_app(fake_engine(), allowed_hosts=allowed_hosts_for("127.0.0.1"))
    with LiveServer(app, server_cls=DrainingServer) as server:
        yield server


def get(server: LiveServer, path: str, host: str | None) -> tuple[int, dict]:
    headers = f"Host: {host}\r\n" if host is not None else ""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\n{headers}\r\n".encode())
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:{port}", "127.0.0.1", "127.0.0.1:{port}", "[::1]", "[::1]:{port}",
     "LocalHost:{port}", "localhost.:{port}"],
)  # fmt: skip
def test_loopback_names_are_served(loopback_server, host):
    host = host.format(port=loopback_server.port)
    assert get(loopback_server, "/health", host) == (200, {"status": "ok"})


@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:{port}", "localhost.evil.example", "127.0.0.2",
     "10.0.0.1:{port}", "[::2]", "localhost:x", "", "localhost:{port}@evil.example"],
)  # fmt: skip
@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics", "/dashboard", "/nope"])
def test_any_other_host_is_421_on_every_route(loopback_server, host, path):
    host = host.format(port=loopback_server.port)
    status, body = get(loopback_server, path, host)
    assert status == 421
    assert body["error"] == {
        "message": f"Host header {host!r}: not a host this server answers to (see --allowed-hosts)",
        "type": "invalid_request_error",
        "param": None,
        "code": "host_not_allowed",
    }


def test_no_host_header_is_421(loopback_server):
    status, body = get(loopback_server, "/health", None)
    assert status == 421 and body["error"]["code"] == "host_not_allowed"
    assert body["error"]["message"].startswith("no Host header")


def test_clients_on_loopback_see_no_difference(loopback_server):
    assert httpx.get(loopback_server.base_url + "/health", timeout=5).status_code == 200
    local = f"http://localhost:{loopback_server.port}/health"
    assert httpx.get(local, timeout=5).status_code == 200
    rebound = httpx.get(
        loopback_server.base_url + "/health", headers={"Host": "attacker.example"}, timeout=5
    )
    assert rebound.status_code == 421


def test_the_defaults_follow_the_bound_address():
    for loopback in ("127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost"):
        assert allowed_hosts_for(loopback) == LOOPBACK_HOSTS == ("localhost", "127.0.0.1", "[::1]")
    for other in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        assert allowed_hosts_for(other) is None  # any
    assert allowed_hosts_for("0.0.0.0", ["api.example.com,10.0.0.5:8000", "::1"]) == (
        "api.example.com",
        "10.0.0.5:8000",
        "::1",
    )
    assert allowed_hosts_for("127.0.0.1", ["*"]) is None
    assert allowed_hosts_for("127.0.0.1", ["", " "]) == LOOPBACK_HOSTS


def test_the_flag_is_repeatable_and_validated():
    args = build_parser().parse_args(["serve", "--allowed-hosts", "a,b", "--allowed-hosts", "c"])
    assert allowed_hosts_for(args.host, args.allowed_hosts) == ("a", "b", "c")
    assert build_parser().parse_args(["serve"]).allowed_hosts == []
    for bad in ("http://x", "x/y", "user@x", "x:0", "x:99999", "x:port", "[::1", "[zz]", "a b"):
        with pytest.raises(ValueError, match="^allowed_hosts: "):
            parse_allowed_hosts([bad])
    with pytest.raises(ValueError, match="^allowed_hosts: "):
        create_app(fake_engine(), allowed_hosts=["x/y"])


def test_a_port_given_is_the_only_one_served_and_star_serves_any():
    app = create_app(fake_engine(), allowed_hosts=["api.example.com:8000", "::1"])
    with LiveServer(app) as server:
        assert get(server, "/health", "api.example.com:8000")[0] == 200
        assert get(server, "/health", "API.example.com:8000")[0] == 200
        assert get(server, "/health", "api.example.com:8001")[0] == 421
        assert get(server, "/health", "api.example.com")[0] == 421
        assert get(server, "/health", "[::1]:9")[0] == 200
        assert get(server, "/health", "[0:0:0:0:0:0:0:1]")[0] == 200
    with LiveServer(create_app(fake_engine(), allowed_hosts=["*"])) as server:
        assert get(server, "/health", "anything.example")[0] == 200

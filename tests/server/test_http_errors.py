"""Requests uvicorn cannot parse, on ``DrainingServer`` (what ``kvwise serve`` runs): an OpenAI
error body instead of uvicorn's plain-text 400 (431 for oversized headers), the connection
closed without a reset, and the server serving on."""

from __future__ import annotations

import http.client
import json
import socket

import httpx
import pytest

from kvwise.server import create_app
from kvwise.server.serving import DrainingServer
from tests.fakes import fake_engine

from .conftest import LiveServer

BIG_HEADER = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(fake_engine()), server_cls=DrainingServer) as server:
        yield server


def exchange(server: LiveServer, request: bytes) -> tuple[http.client.HTTPResponse, dict]:
    """Send ``request`` whole, read the response, and check the server then closes cleanly."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(request)  # a reset here would mean the server closed on unread input
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = json.loads(response.read())
        assert sock.recv(1) == b""  # closed: end of stream, not a reset
    assert response.getheader("Content-Type") == "application/json"
    assert response.getheader("Connection") == "close"
    return response, body["error"]


def test_oversized_header_is_431_json(server):
    response, error = exchange(server, BIG_HEADER)
    assert response.status == 431
    assert error == {
        "message": "request line and headers: larger than the server's limit of 16384 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_header_too_large",
    }
    r = httpx.get(server.base_url + "/health", headers={"X-Big": "a" * (1 << 20)}, timeout=5)
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_too_large"
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_malformed_request_line_is_400_json(server):
    response, error = exchange(server, b"GARBAGE\r\n\r\n")
    assert response.status == 400
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("invalid HTTP request: illegal request line")
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_unsupported_transfer_encoding_is_501_json(server):
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"
    response, error = exchange(server, request)
    assert response.status == 501 and error["code"] == "invalid_http_request"


def test_oversized_header_after_a_good_request_on_the_same_connection(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + BIG_HEADER)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    first, second = data.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200 OK") and first.endswith(b'{"status":"ok"}')
    assert second.startswith(b"431 ")
    assert (
        json.loads(second.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_header_too_large"
    )

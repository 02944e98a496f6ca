"""What a client may send ``DrainingServer`` (what ``kvwise serve`` runs), and how slowly: a
request head over 16 KiB is a JSON 431 even when it arrives in one read; a head not complete
within the header timeout, or a body not complete within the body timeout, is a JSON 408 and
the connection is closed (one that sent nothing is just closed). The timeouts are 1 s here."""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import logging
import select
import socket
import time

import httpx
import pytest

from kvwise.server import create_app
from kvwise.server.serving import DeadlineTimer, DrainingServer
from tests.fakes import fake_engine

from .conftest import LiveServer

TIMEOUT_S = 1.0
SLACK_S = 3.0  # a loaded machine answers late; never early


@pytest.fixture(scope="module")
def server():
    server_cls = functools.partial(
        DrainingServer, header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S
    )
    with LiveServer(create_app(fake_engine()), server_cls=server_cls) as server:
        yield server


def connect(server: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def read_error(sock: socket.socket) -> tuple[int, dict]:
    """The response on ``sock``, then the server's end of stream (a clean close, not a
    reset)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    body = json.loads(response.read())
    assert response.getheader("Content-Type") == "application/json"
    assert response.getheader("Connection") == "close"
    assert sock.recv(1) == b""
    return response.status, body["error"]


def health_with_head_of(num_bytes: int) -> bytes:
    start = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: "
    return start + b"a" * (num_bytes - len(start) - 4) + b"\r\n\r\n"


@pytest.mark.parametrize("num_bytes", [20_000, 60_000])
def test_a_head_over_the_limit_arriving_whole_is_431(server, num_bytes):
    # under loopback's 64 KiB MTU: one segment, so one read, where h11's own limit (which
    # covers only incomplete heads) never applies
    with connect(server) as sock:
        sock.sendall(health_with_head_of(num_bytes))
        status, error = read_error(sock)
    assert status == 431 and error == {
        "message": "request line and headers: larger than the server's limit of 16384 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_header_too_large",
    }
    r = httpx.get(server.base_url + "/health", headers={"X-Pad": "a" * 100_000}, timeout=5)
    assert r.status_code == 431


def test_a_head_under_the_limit_is_served(server):
    with connect(server) as sock:
        sock.sendall(health_with_head_of(16_000))
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200 and json.loads(response.read()) == {"status": "ok"}


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_timeout(server, caplog):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    start = time.monotonic()
    with connect(server) as sock, caplog.at_level(logging.INFO, logger="kvwise.server"):
        for byte in request:  # a byte every 0.1 s, never the blank line
            sock.sendall(bytes([byte]))
            if answered(sock, within_s=0.1):
                break
        status, error = read_error(sock)
    elapsed = time.monotonic() - start
    assert status == 408 and error == {
        "message": "request line and headers: not received within 1 s",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_timeout",
    }
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S
    assert "408" in caplog.text and "Traceback" not in caplog.text
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def answered(sock: socket.socket, within_s: float) -> bool:
    return bool(select.select([sock], [], [], within_s)[0])


def test_a_connection_that_sends_nothing_is_closed(server):
    start = time.monotonic()
    with connect(server) as sock:
        assert sock.recv(1) == b""  # closed, nothing written
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + SLACK_S


def test_a_slow_head_on_a_kept_alive_connection_gets_its_own_header_timeout(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = http.client.HTTPResponse(sock)
        first.begin()
        assert first.status == 200 and first.read() == b'{"status":"ok"}'
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
        start = time.monotonic()
        status, error = read_error(sock)
    assert status == 408 and error["code"] == "request_timeout"
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + SLACK_S


def completion_head(content_length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % content_length
    )


def test_a_body_that_never_completes_is_408(server, caplog):
    start = time.monotonic()
    with connect(server) as sock, caplog.at_level(logging.INFO):
        sock.sendall(completion_head(100) + b'{"prompt": ')
        status, error = read_error(sock)
    assert status == 408 and error == {
        "message": "request body: not received within 1 s of the headers",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_timeout",
    }
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + SLACK_S
    time.sleep(0.2)  # the app's side of the request ends (it sees a disconnect)
    assert "Traceback" not in caplog.text and "unhandled error" not in caplog.text
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_a_body_dripping_steadily_is_still_cut_at_the_deadline(server):
    start = time.monotonic()
    with connect(server) as sock:
        sock.sendall(completion_head(1000))
        while time.monotonic() - start < 5:
            sock.sendall(b" ")  # a byte every 0.1 s: never idle, never done
            if answered(sock, within_s=0.1):
                break
        status, error = read_error(sock)
    assert status == 408 and error["code"] == "request_timeout"
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + SLACK_S


def test_a_body_refused_before_it_is_read_still_ends_at_the_deadline(server):
    # a 413 by its Content-Length, answered at once; the client drips on regardless
    start = time.monotonic()
    with connect(server) as sock:
        sock.sendall(completion_head(9 << 20))
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 413 and response.read()
        closed, extra = False, b""
        while not closed and time.monotonic() - start < 5:
            try:
                sock.sendall(b" ")
                if answered(sock, within_s=0.1):
                    chunk = sock.recv(4096)
                    closed, extra = not chunk, extra + chunk
            except ConnectionError:
                closed = True
    assert closed and extra == b""  # no second response after the 413
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + SLACK_S


def test_a_body_in_time_is_served(server):
    body = json.dumps({"model": "kvwise", "prompt": "hi", "max_tokens": 2}).encode()
    with connect(server) as sock:
        sock.sendall(completion_head(len(body)) + body[:5])
        time.sleep(0.3)  # a pause well inside the deadline
        sock.sendall(body[5:])
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200, response.read()
        assert json.loads(response.read())["object"] == "text_completion"


def test_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="^header_timeout: expected seconds > 0"):
        DrainingServer(_config(), engine=None, header_timeout_s=0)
    with pytest.raises(ValueError, match="^body_timeout: expected seconds > 0"):
        DrainingServer(_config(), engine=None, body_timeout_s=-1)


def _config():
    import uvicorn

    return uvicorn.Config(lambda scope, receive, send: None)


class EarlyLoop:
    """An event loop whose timers fire at half their delay, as uvloop's may fire a little early
    (its clock is the one cached at the start of an iteration)."""

    def __init__(self, loop):
        self.loop = loop

    def call_later(self, delay, callback):
        return self.loop.call_later(delay / 2, callback)


def test_a_timeout_never_fires_before_its_whole_delay():
    async def main():
        loop = asyncio.get_running_loop()
        fired = loop.create_future()
        start = time.monotonic()
        DeadlineTimer(EarlyLoop(loop), 0.2, lambda: fired.set_result(time.monotonic()))
        cancelled = DeadlineTimer(EarlyLoop(loop), 0.1, lambda: fired.set_result(None))
        await asyncio.sleep(0.06)  # past the early loop's first firing: re-armed, then cancelled
        cancelled.cancel()
        return await fired - start

    assert 0.2 <= asyncio.run(main()) < 0.2 + SLACK_S

"""Running the app: uvicorn's server, with open streams ended cleanly at shutdown, and limits
on what a client may send and how slowly.

On SIGTERM (or Ctrl-C) uvicorn stops accepting, gives open requests its graceful-shutdown
timeout, then cancels whatever still runs: a stream cut that way ends mid-body, and the
client cannot tell a shutdown from a network fault. ``DrainingServer`` stops the engine a
little before that timeout instead (``drain_margin_s``), so every open stream ends with an
error event (503, ``engine_down``) and ``[DONE]``, and the requests finish before uvicorn
would cancel them.

A request uvicorn cannot parse never reaches the app: uvicorn answers it itself, with a
plain-text 400. ``DrainingServer`` serves HTTP/1.1 with ``JSONErrorH11Protocol`` instead, which
sends the same OpenAI error body as the app: 431 (``request_header_too_large``) for a request
line and headers past the limit (uvicorn's ``h11_max_incomplete_event_size``, 16 KiB by
default), otherwise h11's own status (400, or 501 for an unsupported Transfer-Encoding) with
code ``invalid_http_request``.

NOTE: h11 applies its limit only to a request head still incomplete in its buffer; a larger
head that arrives whole in one read (asyncio reads up to 256 KiB at a time) would pass.
``HeadLimitConnection`` measures every head h11 parses (request line + headers, as parsed), so
the limit holds however the bytes arrive.

Slow clients: a connection must deliver a request's line and headers within
``header_timeout_s`` (10 s) of opening, or of the first byte of a later request on it; then
the whole body within ``body_timeout_s`` (30 s) of the end of the headers (a deadline, not an
idle gap: a body dripped a byte at a time cannot hold the connection longer). Past either, the
client gets a 408 (``request_timeout``) and the connection is closed; a connection that sent
nothing at all is just closed. Between requests uvicorn's keep-alive timeout (5 s) applies.

Every error here is followed by a gentle close: the server stops writing, then reads and drops
what the client still sends (the rest of a 1 MB header) until the client closes or ``LINGER_S``
passes, so the error is not lost to a TCP reset.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable

import h11
import uvicorn
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from kvwise.engine.client import EngineClient
from kvwise.server.protocol import APIError

logger = logging.getLogger("kvwise.server")

LINGER_S = 2.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0


def head_bytes(request: h11.Request) -> int:
    """The size of a request line and headers as h11 parsed them (``METHOD target
    HTTP/x.y\\r\\n``, ``name: value\\r\\n`` each, the blank line): never more than was sent."""
    size = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n\r\n")
    return size + sum(len(name) + len(value) + 4 for name, value in request.headers)


class HeadLimitConnection(h11.Connection):
    """An h11 server connection that refuses any request head over ``max_head_bytes`` as h11
    refuses an incomplete one: ``RemoteProtocolError`` with a 431 hint."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes

    def next_event(self):
        event = super().next_event()
        if type(event) is h11.Request and head_bytes(event) > self.max_head_bytes:
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event


class DeadlineTimer:
    """``callback`` once ``delay_s`` have passed by the monotonic clock, never before. The
    loop's own timers may fire early (uvloop's clock is the one cached at the start of the
    loop's iteration), and a client is promised the whole timeout: an early firing re-arms for
    what is left."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, delay_s: float, callback: Callable[[], None]
    ):
        self.loop = loop
        self.deadline = time.monotonic() + delay_s
        self.callback = callback
        self.handle = loop.call_later(delay_s, self._fire)

    def _fire(self) -> None:
        left = self.deadline - time.monotonic()
        if left > 0:
            self.handle = self.loop.call_later(left, self._fire)
        else:
            self.callback()

    def cancel(self) -> None:
        self.handle.cancel()


class JSONErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request it cannot parse with an OpenAI error body
    instead of its plain-text 400, with the head's size limit enforced however it arrives, and
    the header and body timeouts."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s = DEFAULT_BODY_TIMEOUT_S
    lingering = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size
        self.max_head_bytes = DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit
        self.conn = HeadLimitConnection(self.max_head_bytes)
        self.header_timer: DeadlineTimer | None = None
        self.body_timer: DeadlineTimer | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.header_timer = DeadlineTimer(self.loop, self.header_timeout_s, self.header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.lingering:
            super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if not self.lingering:
            self._arm_timers()

    def _arm_timers(self) -> None:
        """After h11 has seen new bytes (or started a new cycle): a head begun and not yet
        complete keeps the header timer running; a body being received, the body timer."""
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.trailing_data[0]:
            if self.header_timer is None:
                self.header_timer = DeadlineTimer(
                    self.loop, self.header_timeout_s, self.header_timed_out
                )
        elif state is not h11.IDLE and self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        if state is h11.SEND_BODY:
            if self.body_timer is None:
                self.body_timer = DeadlineTimer(self.loop, self.body_timeout_s, self.body_timed_out)
        elif self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def _cancel_timers(self) -> None:
        for timer in (self.header_timer, self.body_timer):
            if timer is not None:
                timer.cancel()
        self.header_timer = self.body_timer = None

    def header_timed_out(self) -> None:
        self.header_timer = None
        if self.lingering or self.transport.is_closing():
            return
        if not self.conn.trailing_data[0]:  # nothing sent since the connection opened
            self.transport.close()
            return
        message = f"request line and headers: not received within {self.header_timeout_s:g} s"
        self._send_error(APIError(408, message, code="request_timeout"))

    def body_timed_out(self) -> None:
        self.body_timer = None
        if self.lingering or self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_complete:
            # answered without its body (a 413, a 401): no second response, just the close
            self.transport.close()
            return
        message = f"request body: not received within {self.body_timeout_s:g} s of the headers"
        self._send_error(APIError(408, message, code="request_timeout"))

    def send_400_response(self, msg: str) -> None:
        # NOTE: uvicorn 0.54 calls this only inside ``handle_events``' ``except
        # h11.RemoteProtocolError``; h11 hints the status on that error (431 when the request
        # line and headers outgrow the limit: h11's own check or HeadLimitConnection's).
        exc = sys.exc_info()[1]
        status = getattr(exc, "error_status_hint", 400)
        if status == 431:
            message = (
                f"request line and headers: larger than the server's limit of "
                f"{self.max_head_bytes} bytes"
            )
            error = APIError(431, message, code="request_header_too_large")
        else:
            error = APIError(
                status, f"invalid HTTP request: {exc or msg}", code="invalid_http_request"
            )
        self._send_error(error)

    def _send_error(self, error: APIError) -> None:
        """Write ``error`` as a whole response (directly: h11's state no longer matters, the
        connection ends here), then close the connection gently. A request in flight sees a
        disconnect; one whose response has begun is cut (no second response can follow)."""
        self._cancel_timers()
        logger.info("%s: closing the connection: %d %s", self.client, error.status_code, error)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # the app's reads now see a disconnect, and whatever it still sends is dropped
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        status = error.status_code
        body = json.dumps(error.body()).encode()
        head = [b"HTTP/1.1 %d %s\r\n" % (status, STATUS_PHRASES[status])]
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        head += [name + b": " + value + b"\r\n" for name, value in headers]
        self.transport.write(b"".join(head) + b"\r\n" + body)
        # NOTE: closing a socket with unread input sends a reset, which may discard the
        # response before the client reads it; a half-close sends it, then a FIN.
        if self.transport.can_write_eof():
            self.lingering = True
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        engine: EngineClient,
        drain_margin_s: float = 0.5,
        *,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        """Args:
        header_timeout_s: a request's line and headers must arrive within this (408).
        body_timeout_s: its body, within this of the end of its headers (408).
        """
        for name, value in (("header_timeout", header_timeout_s), ("body_timeout", body_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name}: expected seconds > 0, got {value}")
        if config.http in ("auto", "h11"):  # h11 even where httptools is installed
            config.http = type(
                "JSONErrorH11Protocol",
                (JSONErrorH11Protocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
            )
        super().__init__(config)
        self.engine = engine
        self.drain_margin_s = drain_margin_s

    async def shutdown(self, sockets=None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        drain = None
        if timeout is not None:
            delay = max(0.0, timeout - self.drain_margin_s)
            drain = asyncio.get_running_loop().call_later(delay, self._drain)
        try:
            await super().shutdown(sockets)
        finally:
            if drain is not None:
                drain.cancel()

    def _drain(self) -> None:
        if self.server_state.tasks:
            logger.warning(
                "shutdown: %d requests still open; ending them with an error",
                len(self.server_state.tasks),
            )
        self.engine.stop()

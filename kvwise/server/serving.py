"""Running the app: uvicorn's server, with open streams ended cleanly at shutdown.

On SIGTERM (or Ctrl-C) uvicorn stops accepting, gives open requests its graceful-shutdown
timeout, then cancels whatever still runs: a stream cut that way ends mid-body, and the
client cannot tell a shutdown from a network fault. ``DrainingServer`` stops the engine a
little before that timeout instead (``drain_margin_s``), so every open stream ends with an
error event (503, ``engine_down``) and ``[DONE]``, and the requests finish before uvicorn
would cancel them.

A request uvicorn cannot parse never reaches the app: uvicorn answers it itself, with a
plain-text 400. ``DrainingServer`` serves HTTP/1.1 with ``JSONErrorH11Protocol`` instead, which
sends the same OpenAI error body as the app: 431 (``request_header_too_large``) for a request
line and headers past h11's limit (uvicorn's ``h11_max_incomplete_event_size``, 16 KiB by
default), otherwise h11's own status (400, or 501 for an unsupported Transfer-Encoding) with
code ``invalid_http_request``. The connection is closed afterwards, gently: the server stops
writing, then reads and drops what the client still sends (the rest of a 1 MB header) until
the client closes or ``LINGER_S`` passes, so the error is not lost to a TCP reset.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import h11
import uvicorn
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from kvwise.engine.async_engine import AsyncEngine
from kvwise.server.protocol import APIError

logger = logging.getLogger("kvwise.server")

LINGER_S = 2.0


class JSONErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request it cannot parse with an OpenAI error body
    instead of its plain-text 400."""

    lingering = False

    def data_received(self, data: bytes) -> None:
        if not self.lingering:
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        # NOTE: uvicorn 0.54 calls this only inside ``handle_events``' ``except
        # h11.RemoteProtocolError``; h11 hints the status on that error (431 when the request
        # line and headers outgrow the receive buffer's limit).
        exc = sys.exc_info()[1]
        status = getattr(exc, "error_status_hint", 400)
        if status == 431:
            limit = self.config.h11_max_incomplete_event_size
            if limit is None:
                limit = DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
            message = f"request line and headers: larger than the server's limit of {limit} bytes"
            error = APIError(431, message, code="request_header_too_large")
        else:
            error = APIError(
                status, f"invalid HTTP request: {exc or msg}", code="invalid_http_request"
            )
        body = json.dumps(error.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status])
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        # NOTE: closing a socket with unread input sends a reset, which may discard the
        # response before the client reads it; a half-close sends it, then a FIN. Only between
        # requests: a request in flight learns of the close from ``connection_lost``.
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.transport.can_write_eof():
            self.lingering = True
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, drain_margin_s: float = 0.5
    ) -> None:
        if config.http in ("auto", "h11"):  # h11 even where httptools is installed
            config.http = JSONErrorH11Protocol
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

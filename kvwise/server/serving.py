"""Running the app: uvicorn's server, with open streams ended cleanly at shutdown.

On SIGTERM (or Ctrl-C) uvicorn stops accepting, gives open requests its graceful-shutdown
timeout, then cancels whatever still runs: a stream cut that way ends mid-body, and the
client cannot tell a shutdown from a network fault. ``DrainingServer`` stops the engine a
little before that timeout instead (``drain_margin_s``), so every open stream ends with an
error event (503, ``engine_down``) and ``[DONE]``, and the requests finish before uvicorn
would cancel them.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from kvwise.engine.async_engine import AsyncEngine

logger = logging.getLogger("kvwise.server")


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, drain_margin_s: float = 0.5
    ) -> None:
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

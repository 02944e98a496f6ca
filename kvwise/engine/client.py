"""What the HTTP server needs from an engine: the ``EngineClient`` protocol and the stream of
outputs its ``add_request`` returns. No torch, no threads, no I/O here.

Two engines implement it: ``engine/async_engine.AsyncEngine`` (one ``LLMEngine`` stepped on a
thread of this process) and ``cluster/remote.RemoteEngine`` (replicas in other processes,
behind a transport). ``server/`` (create_app, OpenAIRoutes, the dashboard, the metrics, the
draining server) is typed against ``EngineClient`` and calls nothing else on an engine;
``tests/unit/test_engine_client.py`` checks that both engines match it, signatures included.

Contract:

- ``add_request`` returns a ``RequestStream`` once the request is admitted, so an admission
  error (``InvalidRequest`` naming the field, ``QueueFullError``, ``EngineDeadError``: every
  one a ``kvwise.errors.KVWiseError`` carrying its HTTP status) surfaces before any output.
- A request is aborted by closing its stream (``RequestStream.close``): the server does so
  however the response ends, so a client that goes away frees its request's KV blocks.
- ``stats`` and ``cost_curves`` never wait for a step: they answer from the last snapshot
  (immutable, safe from any thread), so a scrape of /metrics never stalls on the engine.
- ``max_model_len``, ``is_running`` and ``dead_reason`` are cheap reads (/health).
- The server never tokenizes: prompts reach the engine as text, chat messages or token ids
  (``engine/prompts.Prompt``); each engine renders and tokenizes them off the event loop.
  ``tokenize`` gives the ids ``add_request`` would compute for a prompt (a count, /tokenize),
  ``detokenize`` the text of ids; both off the event loop too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvwise.engine.prompts import Prompt
    from kvwise.engine.stats import EngineStats
    from kvwise.store.costmodel import CostCurves
    from kvwise.types import RequestOptions, RequestOutput, SamplingParams

__all__ = ["EngineClient", "QueueStream", "RequestStream"]


class RequestStream:
    """The outputs of one admitted request, as an async iterator; each engine subclasses it
    with where its outputs come from (``_next_item``) and how a request is aborted
    (``_abort``).

    Iteration ends after the output with ``finished=True``; an exception item (the step
    failed, the engine died, the replica was lost) is raised and ends it too. ``close()``
    aborts the request if it has not finished; call it in a ``finally``.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self.last: RequestOutput | None = None  # the latest output (the final one once done)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._next_item()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it finished (idempotent, never blocks)."""
        if not self.finished:
            self.finished = True
            self._abort()

    async def _next_item(self) -> RequestOutput | BaseException:
        """The next output, or the error that ends the stream."""
        raise NotImplementedError

    def _abort(self) -> None:
        """Abort the request (fire and forget)."""
        raise NotImplementedError


class QueueStream(RequestStream):
    """A request's outputs as an engine thread delivers them to an asyncio queue (the
    in-process `AsyncEngine`'s streams); ``abort(request_id)`` aborts it."""

    def __init__(self, request_id: str, queue: asyncio.Queue, abort: Callable[[str], None]):
        super().__init__(request_id)
        self._queue = queue
        self._abort_request = abort

    async def _next_item(self) -> RequestOutput | BaseException:
        return await self._queue.get()

    def _abort(self) -> None:
        self._abort_request(self.request_id)


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the server sees it (see the module docstring).

    NOTE: ``isinstance`` against this protocol reads every member, properties included: a
    ``RemoteEngine`` whose first replica has not answered raises from ``max_model_len``.
    """

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output tokens) a request may reach."""
        ...

    @property
    def is_running(self) -> bool:
        """True while requests can be served (/health: 200)."""
        ...

    @property
    def dead_reason(self) -> str | None:
        """Why it is not running (/health's 503 body), or None."""
        ...

    def start(self) -> None:
        """Start serving (the app's start-up calls it); idempotent."""
        ...

    def stop(self) -> None:
        """Stop without waiting: requests in flight end with ``EngineDeadError``."""
        ...

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        options: RequestOptions | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestStream:
        """Admit a request and return its stream (errors: see the module docstring)."""
        ...

    async def park(self, session_id: str, tenant: str = "default") -> int:
        """Move a session's KV from the device pool to the tiers; returns the tokens parked.

        Raises:
            SessionNotFound: no finished turn of that session in this tenant.
            SessionBusy: a request of that session is in flight.
        """
        ...

    async def tool_pause(self, request_id: str) -> int:
        """A finished turn (``request_id``) ended in tool calls: keep its KV ahead of other
        cached blocks until the turn with the tool's result. Returns the tokens kept (0: the
        turn is not remembered, or this client keeps nothing more: a router over replicas)."""
        ...

    async def tokenize(self, prompt: Prompt, tenant: str = "default") -> list[int]:
        """The prompt's token ids as ``add_request`` computes them for ``tenant`` (chat
        messages rendered with the model's template and the generation prompt, unless a
        ``ChatPrompt`` says otherwise; a prompt past the context refused as there).

        Raises:
            InvalidRequest: bad input, naming the field (as ``add_request``).
        """
        ...

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included.

        Raises:
            InvalidRequest: naming ``token_ids``, an id outside the vocabulary.
        """
        ...

    def stats(self) -> EngineStats:
        """The latest statistics snapshot (never waits for a step)."""
        ...

    def cost_curves(self) -> CostCurves | None:
        """The tiered store's cost model as curves (the dashboard's, break-even metrics);
        None without tiers."""
        ...

"""How the app's answers leave: OpenAI error bodies for every failure (``install_error_handlers``:
an engine error by its type's status and code, pydantic's first error naming the field),
server-sent-event responses that run their close hook however they end (``SSEResponse``: the
route aborts its request there), and, for answers that are not streamed, the wait for the
final output that gives up as soon as the client disconnects (``collect_or_disconnect``);
``run_or_disconnect`` does the same for any work (a request's admission, choice by choice)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvwise.engine.client import RequestStream
from kvwise.errors import KVWiseError
from kvwise.server.dialects import error_response
from kvwise.server.protocol import APIError
from kvwise.types import RequestOutput

logger = logging.getLogger("kvwise.server")

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


async def collect_or_disconnect(
    streams: list[RequestStream], request: Request
) -> list[RequestOutput] | None:
    """Wait for every stream's last output, or return None as soon as the client
    disconnects."""

    async def consume(stream: RequestStream) -> RequestOutput | None:
        async for _ in stream:
            pass
        return stream.last

    task = asyncio.ensure_future(asyncio.gather(*(consume(s) for s in streams)))
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
    if not task.done() or task.cancelled():
        return None
    return task.result()  # an engine error propagates: its type carries its status


async def run_or_disconnect(work: Awaitable[None], request: Request) -> bool:
    """Run ``work`` until it is done (True) or the client disconnects first (False: ``work``
    is cancelled, and has ended when this returns). An error of ``work`` propagates."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its cleanup runs now
    if task.cancelled():
        return False
    task.result()
    return True


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """A server-sent-events response that runs ``on_close`` however it ends (done, client
    gone, cancelled), so an abandoned request is aborted even if its stream never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def install_error_handlers(app: FastAPI) -> None:
    """Every failure as an error body in the dialect of the path called
    (``dialects.dialect_for``)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(KVWiseError)
    async def engine_error(request: Request, exc: KVWiseError) -> JSONResponse:
        return await api_error(request, APIError.from_error(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, _validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), code=None, headers=exc.headers)
        if exc.status_code == 404:
            error = _unknown_route(request)
        return error_response(request, error)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        error = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
        return error_response(request, error)


def _unknown_route(request: Request) -> APIError:
    """A 404 that names the routes of the app (those of the path's own API first)."""
    paths = sorted(
        {getattr(r, "path", "") for r in request.app.routes if getattr(r, "methods", None)}
        - {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    )
    return APIError(
        404,
        f"no route {request.method} {request.url.path}; this server serves: {', '.join(paths)}",
        code="unknown_route",
        error_type="not_found_error",
    )


def _validation_error(errors: list[dict]) -> APIError:
    """pydantic's first error → 400 with ``param`` such as ``messages[0].role``."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"invalid JSON body: {first.get('msg')}", code="invalid_json")
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _TYPE_TAGS or any(c in str(part) for c in "[-,"):
            continue  # a union member's tag (``str``, ``list[int]``), not a field
        else:
            param += f".{part}" if param else str(part)
    if not param:
        message = "request body: expected a JSON object" + (
            "" if first.get("type") == "missing" else f" ({first.get('msg')})"
        )
        return APIError(400, message, code="invalid_body")
    return APIError(400, f"{param}: {first.get('msg')}", param=param, code="invalid_value")


async def merged_outputs(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput | APIError]]:
    """Every stream's outputs (or its error: the stream ends with it) with its index, as
    they come."""
    if len(streams) == 1:
        async for out in _outputs_or_error(streams[0]):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in _outputs_or_error(stream):
                await queue.put((index, out))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, out = await queue.get()
            if out is None:
                remaining -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()


async def _outputs_or_error(stream: RequestStream) -> AsyncIterator[RequestOutput | APIError]:
    """The stream's outputs; an engine failure becomes its ``APIError`` (the last item)."""
    try:
        async for out in stream:
            yield out
    except KVWiseError as exc:  # the engine died or the step failed mid-stream
        yield APIError.from_error(exc)

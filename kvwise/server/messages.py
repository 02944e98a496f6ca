"""Anthropic's Messages API over the API-neutral ``generation.Generation``:

- ``POST /v1/messages``: a message (JSON), or with ``stream`` Anthropic's events;
- ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the tokens of the prompt the
  same body would run (the engine's ``tokenize``: rendered and counted as ``add_request``
  does, so it equals the three input counts of the message's usage).

The request's translation is ``anthropic_protocol.py``, the answer's ``anthropic_outputs.py``.
``cache_control`` breakpoints (``cache_breakpoint_prefixes``) are counted in tokens by
``cache_usage.cache_breakpoints`` and kept by the engine (``core/breakpoints.py``).
Auth (``x-api-key`` or ``Authorization: Bearer``), tenants, admission, disconnects and errors
are the server's, in Anthropic's error shape under ``/v1/messages`` (``dialects.py``); the
``anthropic-version`` header is accepted, whatever it says.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvwise.errors import InvalidRequest
from kvwise.server.anthropic_outputs import MessageEvents, MessageResponse, TokenCount, message_of
from kvwise.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvwise.server.cache_usage import cache_breakpoints
from kvwise.server.dialects import ANTHROPIC
from kvwise.server.generation import Generation, ServerContext
from kvwise.server.validation import check_unicode

_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


class MessagesRoutes:
    """The Messages routes of one app (one engine, one model name)."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen

    async def create(self, body: MessagesRequest, request: Request):
        check_unicode(body, await request.body())  # first: nothing may echo or tokenize it
        self.gen.check_model(body.model)
        body.check_supported()
        message_id = f"msg_{uuid.uuid4().hex}"
        prompt = body.prompt_of()
        body._cache_breakpoints = await self._breakpoints(body, prompt, request.state.tenant)
        streams = await self.gen.admit_all(
            body, [prompt], message_id, request, "messages", body.max_tokens
        )
        if streams is None:
            return Response(status_code=499)
        model, names = self.gen.model_name, body.tool_names()
        if body.stream:

            def paused() -> None:
                asyncio.ensure_future(self.gen.tool_pause(message_id))

            events = MessageEvents(message_id, model, names, paused)
            tenant = request.state.tenant
            return self.gen.sse(streams, tenant, events.on_output, dialect=ANTHROPIC)
        outs = await self.gen.collect(streams, request)
        if outs is None:
            return Response(status_code=499)
        message = message_of(outs[0], message_id, model, names)
        if message.stop_reason == "tool_use":
            await self.gen.tool_pause(message_id)
        return message

    async def _breakpoints(self, body: MessagesRequest, prompt, tenant: str) -> tuple:
        """The request's cache_control breakpoints in tokens (``cache_usage``): what each
        marked prefix shares with the prompt, both tokenized by the engine."""
        prefixes = body.cache_breakpoint_prefixes()
        if not prefixes:
            return ()
        try:
            return await cache_breakpoints(self.gen.engine, prompt, prefixes, tenant)
        except InvalidRequest as exc:
            raise (exc.renamed("messages") if exc.param == "prompt" else exc) from None

    async def count_tokens(self, body: CountTokensRequest, request: Request) -> TokenCount:
        check_unicode(body, await request.body())
        self.gen.check_model(body.model)
        body.check_supported()
        try:
            token_ids = await self.gen.engine.tokenize(body.prompt_of(), request.state.tenant)
        except InvalidRequest as exc:
            raise (exc.renamed("messages") if exc.param == "prompt" else exc) from None
        return TokenCount(input_tokens=len(token_ids))


def add_routes(app: FastAPI, context: ServerContext) -> None:
    """Register ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""
    routes = MessagesRoutes(context.gen)
    app.post("/v1/messages", response_model=MessageResponse, responses={200: {"content": _SSE}})(
        routes.create
    )
    app.post("/v1/messages/count_tokens", response_model=TokenCount)(routes.count_tokens)

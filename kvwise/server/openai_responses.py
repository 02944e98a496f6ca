"""OpenAI's Responses API over the API-neutral ``generation.Generation``:
``POST /v1/responses`` (JSON, or ``stream``: the Responses events, no ``[DONE]``),
``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``.

A request's conversation is the stored conversation of its ``previous_response_id`` (the
caller's tenant's only: ``conversations.ResponseStore``) followed by its ``input`` items; it is
rendered as chat messages (``responses_protocol.chat_prompt``), so a next turn's prompt begins
with the tokens of the previous turn's prompt and answer and reads them from the prefix cache.
The answer's text is read into output items (a message, function calls: ``tools``' parser) by
``responses_output.ResponseWriter``; with ``store`` (the default) the response and its
conversation are kept for the next turn, ``GET`` and ``DELETE``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvwise.errors import InvalidRequest
from kvwise.server.conversations import ResponseStore, StoredResponse, StoreLimits
from kvwise.server.dialects import RESPONSES
from kvwise.server.generation import Generation, ServerContext
from kvwise.server.protocol import APIError, ErrorResponse, check_unicode
from kvwise.server.responses_output import ResponseWriter, new_response_id, response_head
from kvwise.server.responses_protocol import ResponsesRequest, chat_prompt
from kvwise.types import RequestOutput


def _not_found(response_id: str, param: str | None = None) -> APIError:
    """The one answer for an id the caller's tenant has not stored (never stored, expired,
    deleted, or another tenant's): the same body whichever it is."""
    return APIError(
        404,
        f"No response found with id '{response_id[:64]}'.",
        param=param,
        code="previous_response_not_found" if param else "not_found",
        error_type="invalid_request_error",
    )


class ResponsesRoutes:
    """The Responses routes over one ``Generation`` and one ``ResponseStore``."""

    def __init__(self, gen: Generation, store: ResponseStore) -> None:
        self.gen = gen
        self.store = store

    async def create(self, body: ResponsesRequest, request: Request):
        tenant = request.state.tenant
        check_unicode(body, await request.body())  # first: nothing may echo or tokenize it
        self.gen.check_model(body.model)
        body.check_supported()
        previous = None
        if body.previous_response_id is not None:
            previous = self.store.get(tenant, body.previous_response_id, touch=True)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
        new_items = body.input_items()
        items = [*previous.items, *new_items] if previous is not None else new_items
        response_id = new_response_id()
        streams = await self._admit(body, items, response_id, request)
        if streams is None:
            return Response(status_code=499)
        writer = ResponseWriter(
            response_head(body, response_id, self.gen.model_name), body.tool_names(), body.stream
        )

        def done(out: RequestOutput) -> dict[str, Any]:
            response = writer.response(out)
            if body.store:
                self.store.put(tenant, response, items + writer.conversation_items(), previous)
            return response

        if body.stream:

            def on_output(index: int, out: RequestOutput) -> str | None:
                events = writer.feed(out.delta_text) if out.delta_text else ""
                if out.finished:
                    events += writer.finish(out)
                    if writer.made_calls:
                        asyncio.ensure_future(self.gen.tool_pause(response_id))
                return events or None

            def last(outs: list[RequestOutput]) -> str:
                return writer.closing(done(outs[0]))

            return self.gen.sse(
                streams,
                tenant,
                on_output,
                dialect=RESPONSES,
                first=writer.opening,
                last=last,
                on_error=writer.error,
            )
        outs = await self.gen.collect(streams, request)
        if outs is None:
            return Response(status_code=499)
        writer.feed(outs[0].text)
        writer.finish(outs[0])
        if writer.made_calls:
            await self.gen.tool_pause(response_id)
        return JSONResponse(done(outs[0]))

    async def _admit(
        self,
        body: ResponsesRequest,
        items: list[dict[str, Any]],
        response_id: str,
        request: Request,
    ):
        """The conversation rendered and admitted (None: the client went away first)."""
        prompt = chat_prompt(items, body.instructions, body.chat_tools())
        try:
            return await self.gen.admit_all(
                body, [prompt], response_id, request, "input", self.gen.engine.max_model_len
            )
        except InvalidRequest as exc:  # the rendered messages are the client's input
            raise (exc.renamed("input") if exc.param == "messages" else exc) from None

    def _stored(self, request: Request, response_id: str) -> StoredResponse:
        entry = self.store.get(request.state.tenant, response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry

    async def retrieve(self, response_id: str, request: Request):
        return JSONResponse(self._stored(request, response_id).response)

    async def delete(self, response_id: str, request: Request):
        self._stored(request, response_id)
        self.store.delete(request.state.tenant, response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def add_routes(app: FastAPI, context: ServerContext) -> None:
    """Register the Responses routes; the store's bounds are ``app.state.responses_store_limits``
    (``create_app``'s ``responses_store``; the defaults without it)."""
    limits = getattr(app.state, "responses_store_limits", None) or StoreLimits()
    routes = ResponsesRoutes(context.gen, ResponseStore(limits))
    app.state.response_store = routes.store
    errors = {
        code: {"model": ErrorResponse, "description": text}
        for code, text in (
            (400, "bad input; `param` names the field"),
            (401, "missing or invalid API key"),
            (404, "unknown model, or previous_response_id not stored for this tenant"),
            (429, "waiting queue full; see Retry-After"),
        )
    }
    sse = {"text/event-stream": {"schema": {"type": "string"}}}
    app.post("/v1/responses", responses={**errors, 200: {"content": sse}})(routes.create)
    found = {404: {"model": ErrorResponse, "description": "no such response for this tenant"}}
    app.get("/v1/responses/{response_id}", responses=found)(routes.retrieve)
    app.delete("/v1/responses/{response_id}", responses=found)(routes.delete)

"""The handlers of the OpenAI-compatible app, one method per route (``app.py`` builds the app,
registers them and documents the routes, tenants and errors). Each generation route admits
its request with the body's ``SamplingParams`` and ``RequestOptions`` (the tenant from the API
key), then answers with JSON or server-sent events; engine errors propagate by type."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvwise.engine.client import EngineClient, RequestStream
from kvwise.errors import InvalidRequest, KVWiseError
from kvwise.server.metrics import ServerMetrics
from kvwise.server.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    ParkRequest,
    ParkResponse,
    PromptTokensDetails,
    Usage,
    check_unicode,
)
from kvwise.server.responses import SSEResponse, collect_or_disconnect
from kvwise.types import RequestOutput

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIRoutes:
    """The handlers of one app, over one async engine serving one model name."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        model_name: str,
        default_completion_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.default_completion_max_tokens = default_completion_max_tokens
        self.created = int(time.time())

    # ---- shared by the generation routes ------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model: '{model}' is not served here (this server serves '{self.model_name}')",
                param="model",
                code="model_not_found",
            )

    async def admit(self, body, prompt, request_id: str, tenant: str, prompt_param: str):
        """Check the body and admit its request; errors propagate by type (see errors.py)."""
        check_unicode(body)  # first: nothing below may echo or tokenize such text
        self.check_model(body.model)
        body.check_supported()
        default_max = (
            self.default_completion_max_tokens
            if isinstance(body, CompletionRequest)
            else self.engine.max_model_len
        )
        try:
            params = body.sampling_params(default_max)
            options = body.request_options(tenant)
            return await self.engine.add_request(prompt, params, options, request_id=request_id)
        except InvalidRequest as exc:
            # the chat prompt is the rendered messages: name the field the client sent
            raise (exc.renamed(prompt_param) if exc.param == "prompt" else exc) from None

    def ended(self, stream: RequestStream, tenant: str) -> None:
        stream.close()
        last = stream.last
        reason = last.finish_reason.value if last and last.finished else "abort"
        self.metrics.observe_request(stream.request_id, tenant, last, reason)

    def sse(
        self,
        stream: RequestStream,
        tenant: str,
        include_usage: bool,
        on_output: Callable[[RequestOutput], str],
        on_usage: Callable[[Usage], str],
        first: str | None = None,
    ) -> SSEResponse:
        """Stream a request as server-sent events: ``first``, one event per output with new
        text (or the end), the usage when asked, then ``[DONE]``."""

        async def events() -> AsyncIterator[str]:
            if first is not None:
                yield first
            async for out in _outputs_or_error(stream):
                if isinstance(out, str):  # an error event: the stream ends with it (and [DONE])
                    yield out
                    yield "data: [DONE]\n\n"
                    return
                if out.delta_text or out.finished:
                    yield on_output(out)
            if include_usage and stream.last is not None:
                yield on_usage(_usage(stream.last))
            yield "data: [DONE]\n\n"

        return SSEResponse(events(), on_close=lambda: self.ended(stream, tenant))

    async def collect(self, stream: RequestStream, request: Request, tenant: str):
        """The final output, or None when the client went away first."""
        try:
            return await collect_or_disconnect(stream, request)
        finally:
            self.ended(stream, tenant)

    # ---- routes -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        tenant = request.state.tenant
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self.admit(body, body.prompt_of(), request_id, tenant, "prompt")
        now, model = int(time.time()), self.model_name

        def chunk(text: str, finish: str | None = None, usage: Usage | None = None) -> str:
            choices = [] if usage else [CompletionChoice(text=text, finish_reason=finish)]
            c = CompletionResponse(
                id=request_id, created=now, model=model, choices=choices, usage=usage
            )
            return f"data: {c.model_dump_json()}\n\n"

        if body.stream:
            return self.sse(
                stream,
                tenant,
                body.include_usage,
                on_output=lambda out: chunk(out.delta_text, _finish(out)),
                on_usage=lambda usage: chunk("", usage=usage),
            )
        out = await self.collect(stream, request, tenant)
        if out is None:
            return Response(status_code=499)
        choice = CompletionChoice(text=out.text, finish_reason=_finish(out))
        return CompletionResponse(
            id=request_id, created=now, model=model, choices=[choice], usage=_usage(out)
        )

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        tenant = request.state.tenant
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.admit(body, body.messages_of(), request_id, tenant, "messages")
        now, model = int(time.time()), self.model_name

        def chunk(delta: DeltaMessage | None, finish: str | None = None, usage=None) -> str:
            choices = [] if delta is None else [ChatStreamChoice(delta=delta, finish_reason=finish)]
            c = ChatCompletionChunk(
                id=request_id, created=now, model=model, choices=choices, usage=usage
            )
            return f"data: {c.model_dump_json()}\n\n"

        if body.stream:
            return self.sse(
                stream,
                tenant,
                body.include_usage,
                on_output=lambda out: chunk(
                    DeltaMessage(content=out.delta_text or None), _finish(out)
                ),
                on_usage=lambda usage: chunk(None, usage=usage),
                first=chunk(DeltaMessage(role="assistant", content="")),
            )
        out = await self.collect(stream, request, tenant)
        if out is None:
            return Response(status_code=499)
        choice = ChatChoice(message=AssistantMessage(content=out.text), finish_reason=_finish(out))
        return ChatCompletionResponse(
            id=request_id, created=now, model=model, choices=[choice], usage=_usage(out)
        )

    async def park(self, body: ParkRequest, request: Request) -> ParkResponse:
        """Move a conversation's KV to the tiers until its next turn (kvwise extension)."""
        check_unicode(body)
        key = body.prompt_cache_key
        try:
            parked_tokens = await self.engine.park(key, request.state.tenant)
        except InvalidRequest as exc:  # SessionNotFound (404), SessionBusy (409)
            raise (exc.renamed("prompt_cache_key") if exc.param == "session_id" else exc) from None
        return ParkResponse(prompt_cache_key=key, parked_tokens=parked_tokens)

    async def list_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created)])

    async def get_model(self, model: str) -> ModelCard:
        self.check_model(model)
        return ModelCard(id=self.model_name, created=self.created)

    async def health(self):
        if self.engine.is_running:
            return Health(status="ok")
        reason = self.engine.dead_reason or "the engine is not started"
        return JSONResponse(Health(status=reason).model_dump(), status_code=503)

    async def prometheus_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---- helpers ---------------------------------------------------------------------------------


def _usage(out: RequestOutput) -> Usage:
    num_generated = len(out.token_ids)
    return Usage(
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=num_generated,
        total_tokens=out.num_prompt_tokens + num_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=int(out.num_cached_tokens)),
    )


def _finish(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason else None


async def _outputs_or_error(stream: RequestStream) -> AsyncIterator[RequestOutput | str]:
    """The stream's outputs; an engine failure becomes one SSE error event (a string)."""
    try:
        async for out in stream:
            yield out
    except KVWiseError as exc:  # the engine died or the step failed mid-stream
        error = APIError.from_error(exc)
        yield f"data: {ErrorResponse.model_validate(error.body()).model_dump_json()}\n\n"

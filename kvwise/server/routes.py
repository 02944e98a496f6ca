"""The handlers of the OpenAI-compatible app, one method per route (``app.py`` builds the app,
registers them and documents the routes, tenants and errors). Each generation route admits
its request with the body's ``SamplingParams`` and ``RequestOptions`` (the tenant from the API
key), then answers with JSON or server-sent events; engine errors propagate by type."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvwise.engine.client import EngineClient
from kvwise.errors import InvalidRequest
from kvwise.server.generation import DEFAULT_MAX_SEQUENCES_PER_REQUEST, Generation
from kvwise.server.logprobs import chat_logprobs, completion_logprobs, prompt_text
from kvwise.server.metrics import ServerMetrics
from kvwise.server.outputs import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Health,
    ModelCard,
    ModelList,
    ParkResponse,
    PromptTokensDetails,
    Usage,
)
from kvwise.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ParkRequest,
    check_unicode,
)
from kvwise.server.responses import SSEResponse
from kvwise.server.tools import ToolCallStream, parse_cut_answer, parse_tool_calls
from kvwise.types import FinishReason, RequestOutput

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIRoutes:
    """The handlers of one app, over one async engine serving one model name: OpenAI's
    Chat Completions and Completions on the API-neutral ``Generation``, and the app's own
    routes (models, health, metrics, park)."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        model_name: str,
        default_completion_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS,
        max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    ) -> None:
        self.gen = Generation(engine, metrics, model_name, max_sequences_per_request)
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.default_completion_max_tokens = default_completion_max_tokens
        self.created = int(time.time())

    # ---- routes -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        tenant = request.state.tenant
        request_id = f"cmpl-{uuid.uuid4().hex}"
        check_unicode(body, await request.body())  # first: nothing may echo or tokenize it
        prompts = body.prompts_of()
        limit = self.default_completion_max_tokens
        streams = await self.gen.admit_all(
            body, prompts, request_id, request, "prompt", limit, body.n
        )
        if streams is None:
            return Response(status_code=499)
        now, model, n = int(time.time()), self.model_name, body.n
        echo_only = body.max_tokens == 0

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            c = CompletionResponse(
                id=request_id, created=now, model=model, choices=choices, usage=usage
            )
            return f"data: {c.model_dump_json()}\n\n"

        def text_before(index: int, out: RequestOutput) -> str:
            if not body.echo:
                return ""
            prompt = prompts[index // n]
            return prompt if isinstance(prompt, str) else prompt_text(out)

        if body.stream:
            sent = [0] * len(streams)  # output tokens already streamed, per choice

            def on_output(index: int, out: RequestOutput) -> str | None:
                if not (out.delta_text or out.finished):
                    return None
                text = (text_before(index, out) if sent[index] == 0 else "") + out.delta_text
                logprobs = None
                if body.logprobs is not None:
                    start, sent[index] = sent[index], len(out.token_ids)
                    logprobs = completion_logprobs(
                        _tail(out, start), False, len(out.token_ids) - start
                    )
                sent[index] = max(sent[index], 1)
                choice = CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=_finish(out)
                )
                return chunk([choice])

            last = _usage_event(body.include_usage, n, lambda usage: chunk([], usage))
            return self.gen.sse(streams, tenant, on_output, last=last)
        outs = await self.gen.collect(streams, request)
        if outs is None:
            return Response(status_code=499)
        choices = [
            _completion_choice(index, out, body, text_before(index, out))
            for index, out in enumerate(outs)
        ]
        usage = _usage(outs, n, generated=0 if echo_only else None)
        return CompletionResponse(
            id=request_id, created=now, model=model, choices=choices, usage=usage
        )

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        tenant = request.state.tenant
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        check_unicode(body, await request.body())  # first: nothing may echo or tokenize it
        limit = self.engine.max_model_len
        prompts = [body.prompt_of()]
        streams = await self.gen.admit_all(
            body, prompts, request_id, request, "messages", limit, body.n
        )
        if streams is None:
            return Response(status_code=499)
        now, model = int(time.time()), self.model_name
        names = {t.function.name for t in body.tools or ()} if body.calls_tools else set()

        def chunk(choices: list[ChatStreamChoice], usage=None) -> str:
            c = ChatCompletionChunk(
                id=request_id, created=now, model=model, choices=choices, usage=usage
            )
            return f"data: {c.model_dump_json()}\n\n"

        if body.stream:
            return self._chat_stream(body, streams, tenant, chunk, names)
        outs = await self.gen.collect(streams, request)
        if outs is None:
            return Response(status_code=499)
        choices = []
        for index, out in enumerate(outs):
            content, calls = _answer(out, names)
            finish = "tool_calls" if calls and not _cut(out) else _finish(out)
            if finish == "tool_calls":
                await self.gen.tool_pause(streams[index].request_id)
            message = AssistantMessage(content=content, tool_calls=calls or None)
            logprobs = chat_logprobs(out, 0, len(out.token_ids)) if body.logprobs else None
            choices.append(
                ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish)
            )
        return ChatCompletionResponse(
            id=request_id, created=now, model=model, choices=choices, usage=_usage(outs, body.n)
        )

    def _chat_stream(self, body, streams, tenant: str, chunk, names: set[str]) -> SSEResponse:
        """A chat answer as events. With tools, each answer is read by a ``ToolCallStream``:
        its content goes out as it comes (less what may begin a call), each call as soon as
        its name is complete, then its arguments piece by piece; an answer that made calls
        ends with ``finish_reason: tool_calls``, one cut inside a call with ``length`` (the
        call's arguments: their text so far)."""
        sent = [0] * len(streams)  # output tokens already streamed, per choice
        parsers = [ToolCallStream(names) if names else None for _ in streams]

        def on_output(index: int, out: RequestOutput) -> str | None:
            if not (out.delta_text or out.finished):
                return None
            text, finish, deltas = out.delta_text, _finish(out), []
            parser = parsers[index]
            if parser is not None:
                text, deltas = parser.feed(text)
                if out.finished:
                    more, last = parser.finish(cut=_cut(out))
                    text, deltas = text + more, deltas + last
                    if parser.calls and not _cut(out):
                        finish = "tool_calls"
                        asyncio.ensure_future(self.gen.tool_pause(streams[index].request_id))
                elif not (text or deltas):
                    return None
            start, sent[index] = sent[index], len(out.token_ids)
            logprobs = chat_logprobs(out, start, len(out.token_ids)) if body.logprobs else None
            delta = DeltaMessage(content=text or None, tool_calls=deltas or None)
            return chunk(
                [
                    ChatStreamChoice(
                        index=index, delta=delta, logprobs=logprobs, finish_reason=finish
                    )
                ]
            )

        def first() -> str:
            delta = DeltaMessage(role="assistant", content="")
            return "".join(
                chunk([ChatStreamChoice(index=index, delta=delta)]) for index in range(len(streams))
            )

        last = _usage_event(body.include_usage, body.n, lambda usage: chunk([], usage))
        return self.gen.sse(streams, tenant, on_output, first=first, last=last)

    async def park(self, body: ParkRequest, request: Request) -> ParkResponse:
        """Move a conversation's KV to the tiers until its next turn (kvwise extension)."""
        check_unicode(body, await request.body())
        key = body.prompt_cache_key
        try:
            parked_tokens = await self.engine.park(key, request.state.tenant)
        except InvalidRequest as exc:  # SessionNotFound (404), SessionBusy (409)
            raise (exc.renamed("prompt_cache_key") if exc.param == "session_id" else exc) from None
        return ParkResponse(prompt_cache_key=key, parked_tokens=parked_tokens)

    async def list_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created)])

    async def get_model(self, model: str) -> ModelCard:
        self.gen.check_model(model)
        return ModelCard(id=self.model_name, created=self.created)

    async def health(self):
        if self.engine.is_running:
            store = self.engine.stats().store
            tiers = store.tiers.items() if store is not None else ()
            degraded = {name: t.degraded for name, t in tiers if t.degraded}
            if degraded:
                return Health(status="degraded", degraded_tiers=degraded).model_dump()
            return Health(status="ok").model_dump(exclude_none=True)
        reason = self.engine.dead_reason or "the engine is not started"
        return JSONResponse(Health(status=reason).model_dump(), status_code=503)

    async def prometheus_metrics(self, request: Request) -> Response:
        # the bill per tenant too for a scrape that may see the dashboard (dashboard.AdminGate)
        tenants = request.scope.get("state", {}).get("admin", False)
        return Response(self.metrics.render(tenants), media_type=CONTENT_TYPE_LATEST)


# ---- helpers ---------------------------------------------------------------------------------


def _completion_choice(
    index: int, out: RequestOutput, body: CompletionRequest, before: str
) -> CompletionChoice:
    """One choice of a whole completion: ``before`` (the echoed prompt) and its text."""
    echo_only = body.max_tokens == 0
    logprobs = None
    if body.logprobs is not None:
        num_outputs = 0 if echo_only else len(out.token_ids)
        logprobs = completion_logprobs(out, body.echo, num_outputs)
    text = before + ("" if echo_only else out.text)
    finish = "length" if echo_only else _finish(out)
    return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)


def _usage_event(include: bool, per_prompt: int, event: Callable[[Usage], str]):
    """A stream's closing usage chunk (``stream_options.include_usage``), or None."""
    if not include:
        return None
    return lambda outs: event(_usage(outs, per_prompt))


def _usage(outs: list[RequestOutput], per_prompt: int = 1, generated: int | None = None) -> Usage:
    """The choices' usage: each prompt counted once (its first choice's), every choice's
    output tokens (``generated``: each choice's, when its tokens were dropped)."""
    firsts = outs[::per_prompt]
    prompt = sum(out.num_prompt_tokens for out in firsts)
    num_generated = sum(len(out.token_ids) if generated is None else generated for out in outs)
    cached = sum(int(out.num_cached_tokens) for out in firsts)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=num_generated,
        total_tokens=prompt + num_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _tail(out: RequestOutput, start: int) -> RequestOutput:
    """The output with its first ``start`` tokens left out (a stream's new tokens)."""
    tops = out.top_logprobs[start:] if out.top_logprobs is not None else None
    return dataclasses.replace(
        out, token_ids=out.token_ids[start:], logprobs=out.logprobs[start:], top_logprobs=tops
    )


def _cut(out: RequestOutput) -> bool:
    """The answer was cut by ``max_tokens`` (or the context): a call in it is truncated, and
    the answer ends with ``length``, not ``tool_calls``, as OpenAI's does."""
    return out.finish_reason == FinishReason.LENGTH


def _answer(out: RequestOutput, names: set[str]) -> tuple[str | None, list]:
    """A whole answer's content and tool calls (a truncated call's arguments: their text)."""
    if not names:
        return out.text, []
    return (parse_cut_answer if _cut(out) else parse_tool_calls)(out.text, names)


def _finish(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason else None

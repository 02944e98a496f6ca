"""The handlers of the OpenAI-compatible app, one method per route (``app.py`` builds the app,
registers them and documents the routes, tenants and errors). Each generation route admits
its request with the body's ``SamplingParams`` and ``RequestOptions`` (the tenant from the API
key), then answers with JSON or server-sent events; engine errors propagate by type."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvwise.engine.client import EngineClient, RequestStream
from kvwise.errors import InvalidRequest
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
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ParkRequest,
    check_unicode,
)
from kvwise.server.responses import (
    SSEResponse,
    collect_or_disconnect,
    merged_outputs,
    run_or_disconnect,
)
from kvwise.server.tools import ToolCallStream, parse_tool_calls
from kvwise.types import RequestOutput

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# n x prompts of one request: as many as the engine runs at once by default (--max-num-seqs
# 64), so one body can fill a batch but not queue up hundreds of sequences behind it
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 64


class OpenAIRoutes:
    """The handlers of one app, over one async engine serving one model name."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        model_name: str,
        default_completion_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS,
        max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    ) -> None:
        if max_sequences_per_request < 1:
            raise ValueError(
                f"max_sequences_per_request: expected at least 1, got {max_sequences_per_request}"
            )
        self.engine = engine
        self.max_sequences_per_request = max_sequences_per_request
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

    async def admit(self, body, prompt, request_id: str, tenant: str, prompt_param: str,
                    choice: int = 0):  # fmt: skip
        """Check the body and admit its request (``choice`` j of n: its seed + j); errors
        propagate by type (see errors.py)."""
        self.check_model(body.model)
        body.check_supported()
        default_max = (
            self.default_completion_max_tokens
            if isinstance(body, CompletionRequest)
            else self.engine.max_model_len
        )
        try:
            params = body.sampling_params(default_max)
            if choice and params.seed is not None:
                params = dataclasses.replace(params, seed=(params.seed + choice) % 2**32)
            options = body.request_options(tenant)
            return await self.engine.add_request(prompt, params, options, request_id=request_id)
        except InvalidRequest as exc:
            # the chat prompt is the rendered messages: name the field the client sent
            raise (exc.renamed(prompt_param) if exc.param == "prompt" else exc) from None

    def check_sequences(self, n: int, num_prompts: int) -> None:
        """400 naming ``prompt`` (more prompts than the cap) or ``n`` when n × prompts
        sequences would pass ``max_sequences_per_request``."""
        cap = self.max_sequences_per_request
        if n * num_prompts <= cap:
            return
        param = "prompt" if num_prompts > cap else "n"
        asked = f"{n} choices x {num_prompts} prompts" if num_prompts > 1 else f"{n} choices"
        raise APIError(
            400,
            f"{param}: {asked} = {n * num_prompts} sequences, more than this server's limit of "
            f"{cap} per request (--max-sequences-per-request)",
            param=param,
            code="too_many_sequences",
        )

    async def admit_all(
        self, body, prompts, request_id: str, tenant: str, prompt_param: str, request: Request
    ) -> list[RequestStream] | None:
        """Every choice of every prompt (n each, choice i * n + j), in order: a later choice
        of a prompt finds the first one's prefill under way and shares its blocks. One
        refused: the others are aborted and the error propagates. The client hangs up
        before all are admitted: the admitted ones are aborted, the rest never admitted
        (None)."""
        self.check_sequences(body.n, len(prompts))
        streams: list[RequestStream] = []
        num_sequences = len(prompts) * body.n

        async def admit_each() -> None:
            for prompt in prompts:
                for j in range(body.n):
                    rid = request_id if num_sequences == 1 else f"{request_id}-{len(streams)}"
                    streams.append(await self.admit(body, prompt, rid, tenant, prompt_param, j))

        try:
            admitted = await run_or_disconnect(admit_each(), request)
        except BaseException:
            for stream in streams:
                self.ended(stream, tenant)
            raise
        if not admitted:
            self.hung_up(streams, tenant, num_sequences)
            return None
        return streams

    def hung_up(self, streams: list[RequestStream], tenant: str, num_sequences: int) -> None:
        """The client went away before its answer was whole: every stream aborted (KV freed
        at the engine's next step), and the request counted as cancelled with its
        ``num_sequences`` less those that had finished."""
        num_finished = sum(1 for s in streams if s.last is not None and s.last.finished)
        for stream in streams:
            self.ended(stream, tenant)
        self.metrics.observe_cancelled(num_sequences - num_finished)

    def ended(self, stream: RequestStream, tenant: str) -> None:
        stream.close()
        last = stream.last
        reason = last.finish_reason.value if last and last.finished else "abort"
        self.metrics.observe_request(stream.request_id, tenant, last, reason)

    def sse(
        self,
        streams: list[RequestStream],
        tenant: str,
        include_usage: bool,
        on_output: Callable[[int, RequestOutput], str | None],
        on_usage: Callable[[Usage], str],
        first: Callable[[int], str] | None = None,
        per_prompt: int = 1,
    ) -> SSEResponse:
        """Stream requests as server-sent events: ``first(choice)`` for each, then their
        outputs as they come (``on_output``: an event, or None for none), the usage when
        asked, then ``[DONE]``."""

        done = False  # [DONE] was sent: the client did not hang up first

        async def events() -> AsyncIterator[str]:
            nonlocal done
            if first is not None:
                for index in range(len(streams)):
                    yield first(index)
            async for index, out in merged_outputs(streams):
                if isinstance(out, str):  # an error event: the stream ends with it (and [DONE])
                    yield out
                    yield "data: [DONE]\n\n"
                    done = True
                    return
                event = on_output(index, out)
                if event is not None:
                    yield event
            lasts = [s.last for s in streams]
            if include_usage and all(last is not None for last in lasts):
                yield on_usage(_usage(lasts, per_prompt))
            yield "data: [DONE]\n\n"
            done = True

        def close() -> None:
            if done:
                for stream in streams:
                    self.ended(stream, tenant)
            else:
                self.hung_up(streams, tenant, len(streams))

        return SSEResponse(events(), on_close=close)

    async def collect(self, streams: list[RequestStream], request: Request, tenant: str):
        """Every final output, or None when the client went away first."""
        try:
            outs = await collect_or_disconnect(streams, request)
        except BaseException:  # an engine error (its status answers) or a cancel
            for stream in streams:
                self.ended(stream, tenant)
            raise
        if outs is None:
            self.hung_up(streams, tenant, len(streams))
        else:
            for stream in streams:
                self.ended(stream, tenant)
        return outs

    # ---- routes -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        tenant = request.state.tenant
        request_id = f"cmpl-{uuid.uuid4().hex}"
        check_unicode(body, await request.body())  # first: nothing may echo or tokenize it
        prompts = body.prompts_of()
        streams = await self.admit_all(body, prompts, request_id, tenant, "prompt", request)
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
                choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                          finish_reason=_finish(out))  # fmt: skip
                return chunk([choice])

            return self.sse(streams, tenant, body.include_usage, on_output,
                            on_usage=lambda usage: chunk([], usage), per_prompt=n)  # fmt: skip
        outs = await self.collect(streams, request, tenant)
        if outs is None:
            return Response(status_code=499)
        choices = []
        for index, out in enumerate(outs):
            before = text_before(index, out)
            num_outputs = 0 if echo_only else len(out.token_ids)
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(out, body.echo, num_outputs)
            text = before + ("" if echo_only else out.text)
            finish = "length" if echo_only else _finish(out)
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                            finish_reason=finish))  # fmt: skip
        usage = _usage(outs, n, generated=0 if echo_only else None)
        return CompletionResponse(id=request_id, created=now, model=model, choices=choices,
                                  usage=usage)  # fmt: skip

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        tenant = request.state.tenant
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        check_unicode(body, await request.body())  # first: nothing may echo or tokenize it
        streams = await self.admit_all(
            body, [body.prompt_of()], request_id, tenant, "messages", request
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
        outs = await self.collect(streams, request, tenant)
        if outs is None:
            return Response(status_code=499)
        choices = []
        for index, out in enumerate(outs):
            content, calls = parse_tool_calls(out.text, names) if names else (out.text, [])
            if calls:
                await self.tool_pause(streams[index].request_id)
            message = AssistantMessage(content=content, tool_calls=calls or None)
            logprobs = chat_logprobs(out, 0, len(out.token_ids)) if body.logprobs else None
            finish = "tool_calls" if calls else _finish(out)
            choices.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                      finish_reason=finish))  # fmt: skip
        return ChatCompletionResponse(id=request_id, created=now, model=model, choices=choices,
                                      usage=_usage(outs, body.n))  # fmt: skip

    def _chat_stream(self, body, streams, tenant: str, chunk, names: set[str]) -> SSEResponse:
        """A chat answer as events. With tools, each answer is read by a ``ToolCallStream``:
        its content goes out as it comes (less what may begin a call), each call as soon as
        its name is complete, then its arguments piece by piece; an answer that made calls
        ends with ``finish_reason: tool_calls``."""
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
                    more, last = parser.finish()
                    text, deltas = text + more, deltas + last
                    if parser.calls:
                        finish = "tool_calls"
                        asyncio.ensure_future(self.tool_pause(streams[index].request_id))
                elif not (text or deltas):
                    return None
            start, sent[index] = sent[index], len(out.token_ids)
            logprobs = chat_logprobs(out, start, len(out.token_ids)) if body.logprobs else None
            delta = DeltaMessage(content=text or None, tool_calls=deltas or None)
            return chunk([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                           finish_reason=finish)])  # fmt: skip

        def first(index: int) -> str:
            delta = DeltaMessage(role="assistant", content="")
            return chunk([ChatStreamChoice(index=index, delta=delta)])

        return self.sse(streams, tenant, body.include_usage, on_output,
                        on_usage=lambda usage: chunk([], usage), first=first,
                        per_prompt=body.n)  # fmt: skip

    async def tool_pause(self, request_id: str) -> None:
        """A turn ended in tool calls: the engine keeps its KV for the tool's pause (an
        engine without ``tool_pause``, a router over replicas say, keeps nothing more)."""
        pause = getattr(self.engine, "tool_pause", None)
        if pause is not None:
            await pause(request_id)

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
        self.check_model(model)
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

    async def prometheus_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---- helpers ---------------------------------------------------------------------------------


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
    return dataclasses.replace(out, token_ids=out.token_ids[start:], logprobs=out.logprobs[start:],
                               top_logprobs=tops)  # fmt: skip


def _finish(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason else None

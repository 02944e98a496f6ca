"""The API-neutral half of every generation route: admitting a request's sequences (model,
supported fields, the n x prompts cap, a hang-up during admission), following them to the
end (a JSON answer, or server-sent events framed in the route's dialect), and what happens
when they end or the client goes away (streams closed, KV freed at the engine's next step,
the request counted per tenant and each sequence billed to it once: ``ledger.py``,
cancellations counted). Each API's routes (``routes.py``:
OpenAI's Chat Completions and Completions; the Messages and Responses routes) translate their
body into the engine's prompt, ``SamplingParams`` and ``RequestOptions`` and the engine's
outputs into their own JSON and events; nothing here knows any API's JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from fastapi import Request

from kvwise.engine.client import EngineClient, RequestStream
from kvwise.errors import InvalidRequest
from kvwise.server.dialects import OPENAI, Dialect
from kvwise.server.ledger import bill_of
from kvwise.server.metrics import ServerMetrics
from kvwise.server.price_sheet import PriceSheet
from kvwise.server.protocol import APIError
from kvwise.server.responses import (
    SSEResponse,
    collect_or_disconnect,
    merged_outputs,
    run_or_disconnect,
)
from kvwise.types import RequestOptions, RequestOutput, SamplingParams

# n x prompts of one request: as many as the engine runs at once by default (--max-num-seqs
# 64), so one body can fill a batch but not queue up hundreds of sequences behind it
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 64


class EngineBody(Protocol):
    """What an API's request body turns into for the engine (each dialect's request model)."""

    model: str | None

    def check_supported(self) -> None:
        """Raise ``APIError`` (400 naming the field) for a field the server does not do."""

    def sampling_params(self, default_max_tokens: int) -> SamplingParams: ...

    def request_options(self, tenant: str) -> RequestOptions: ...


@dataclasses.dataclass(frozen=True)
class ServerContext:
    """What a module of routes gets from ``create_app`` (``add_routes(app, context)``)."""

    gen: Generation
    admin_key: str | None  # the dashboard's and admin routes' key (None: open)
    tenant_keys: list[str]  # the API keys (an admin route never accepts one of these)
    price_sheet: PriceSheet | None = None  # prices the ledger's tokens (GET /v1/usage)


class Generation:
    """Admission and the end of a request's sequences, over one engine serving one model."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        model_name: str,
        max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    ) -> None:
        if max_sequences_per_request < 1:
            raise ValueError(
                f"max_sequences_per_request: expected at least 1, got {max_sequences_per_request}"
            )
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.max_sequences_per_request = max_sequences_per_request
        # sequences billed less than their all (ledger.bill_of): request id -> (bill the
        # prompt, bill the output); a later choice's prompt is billed with its first choice's
        self._partial_bills: dict[str, tuple[bool, bool]] = {}

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model: '{model}' is not served here (this server serves '{self.model_name}')",
                param="model",
                code="model_not_found",
            )

    async def admit(
        self,
        body: EngineBody,
        prompt,
        request_id: str,
        tenant: str,
        prompt_param: str,
        default_max_tokens: int,
        choice: int = 0,
    ):
        """Check the body and admit its request (``choice`` j of n: its seed + j); errors
        propagate by type (see errors.py)."""
        self.check_model(body.model)
        body.check_supported()
        try:
            params = body.sampling_params(default_max_tokens)
            if choice and params.seed is not None:
                params = dataclasses.replace(params, seed=(params.seed + choice) % 2**32)
            options = body.request_options(tenant)
            return await self.engine.add_request(prompt, params, options, request_id=request_id)
        except InvalidRequest as exc:
            # a rendered prompt (chat messages, say): name the field the client sent
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
        self,
        body: EngineBody,
        prompts: Sequence,
        request_id: str,
        request: Request,
        prompt_param: str,
        default_max_tokens: int,
        n: int = 1,
    ) -> list[RequestStream] | None:
        """Every choice of every prompt (n each, choice i * n + j), in order: a later choice
        of a prompt finds the first one's prefill under way and shares its blocks. One
        refused: the others are aborted and the error propagates. The client hangs up
        before all are admitted: the admitted ones are aborted, the rest never admitted
        (None)."""
        self.check_sequences(n, len(prompts))
        tenant = request.state.tenant
        streams: list[RequestStream] = []
        num_sequences = len(prompts) * n
        drops_output = getattr(body, "max_tokens", None) == 0  # completions' echo only

        async def admit_each() -> None:
            for prompt in prompts:
                for j in range(n):
                    rid = request_id if num_sequences == 1 else f"{request_id}-{len(streams)}"
                    admitted = self.admit(
                        body, prompt, rid, tenant, prompt_param, default_max_tokens, j
                    )
                    streams.append(await admitted)
                    if j or drops_output:
                        self._partial_bills[rid] = (j == 0, not drops_output)

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
        bill_prompt, bill_output = self._partial_bills.pop(stream.request_id, (True, True))
        self.metrics.ledger.record(tenant, bill_of(last, bill_prompt, bill_output))

    def sse(
        self,
        streams: list[RequestStream],
        tenant: str,
        on_output: Callable[[int, RequestOutput], str | None],
        *,
        dialect: Dialect = OPENAI,
        first: Callable[[], str] | None = None,
        last: Callable[[list[RequestOutput]], str | None] | None = None,
        on_error: Callable[[APIError], str] | None = None,
    ) -> SSEResponse:
        """Stream requests as server-sent events: ``first()`` (the opening events), then
        their outputs as they come (``on_output``: an event, or None for none), then
        ``last(final outputs)`` once all finished, then the dialect's end (``[DONE]`` for
        OpenAI's). An engine error mid-stream ends it with ``on_error(error)``, by default
        the dialect's error event."""

        done = False  # the stream's end was sent: the client did not hang up first

        async def events() -> AsyncIterator[str]:
            nonlocal done
            if first is not None:
                yield first()
            async for index, out in merged_outputs(streams):
                if isinstance(out, APIError):  # the stream ends with it
                    yield (on_error or dialect.stream_error)(out)
                    if dialect.stream_end:
                        yield dialect.stream_end
                    done = True
                    return
                event = on_output(index, out)
                if event is not None:
                    yield event
            lasts = [s.last for s in streams]
            if last is not None and all(out is not None for out in lasts):
                closing = last(lasts)  # type: ignore[arg-type]
                if closing:
                    yield closing
            if dialect.stream_end:
                yield dialect.stream_end
            done = True

        def close() -> None:
            if done:
                for stream in streams:
                    self.ended(stream, tenant)
            else:
                self.hung_up(streams, tenant, len(streams))

        return SSEResponse(events(), on_close=close)

    async def collect(self, streams: list[RequestStream], request: Request):
        """Every final output, or None when the client went away first."""
        tenant = request.state.tenant
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

    async def tool_pause(self, request_id: str) -> None:
        """A turn ended in tool calls: the engine keeps its KV for the tool's pause
        (``EngineClient.tool_pause``)."""
        await self.engine.tool_pause(request_id)

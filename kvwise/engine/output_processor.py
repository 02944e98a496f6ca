"""The ``RequestOutput``s the engine returns for every request in flight: text deltas,
timing, counts. No torch.

The scheduler reports what a step did to each request (``RequestUpdate``), having decided
already whether it ended (``core/stopping.py``: stop strings included). The text is made by
the request's ``stop_parts.TextStop`` as the stop policy hands it each token; this takes what
it made since the last output (at the end, its tail) and turns the update into an output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvwise.core.breakpoints import created_tokens
from kvwise.core.request import Request
from kvwise.core.scheduler import RequestUpdate
from kvwise.engine.detokenize import Decoder
from kvwise.engine.stop_parts import TextStop
from kvwise.types import FinishReason, RequestMetrics, RequestOutput


@dataclass
class _RequestState:
    """Engine-side state of one request: text assembly and timing."""

    request: Request
    text_stop: TextStop  # makes the text (and matches its stop strings)
    metrics: RequestMetrics
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_texts: dict[int, str] | None = None  # logprobs asked: each named id's text


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput]
    finished: list[Request]  # every request that finished in this step
    # its text's tail failed (request id → why): it ended with FinishReason.ERROR
    failed: dict[str, str] = field(default_factory=dict)


class OutputProcessor:
    """Args:
    tokenizer: decodes ids (its special tokens are left out of the text).
    num_layers: the model's layers, to report K/V rows projected.
    """

    def __init__(self, tokenizer: Decoder, num_layers: int) -> None:
        self.tokenizer = tokenizer
        self.num_layers = num_layers
        self._states: dict[str, _RequestState] = {}

    def add(self, request: Request, arrival_time: float, text_stop: TextStop) -> None:
        """Follow ``request``, whose text ``text_stop`` (one of its stop parts) makes."""
        self._states[request.request_id] = _RequestState(
            request=request,
            text_stop=text_stop,
            metrics=RequestMetrics(arrival_time=arrival_time),
        )

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def requests(self) -> list[Request]:
        """The requests in flight."""
        return [state.request for state in self._states.values()]

    def process(self, updates: list[RequestUpdate]) -> ProcessedStep:
        now = time.perf_counter()
        step = ProcessedStep([], [])
        for update in updates:
            state = self._states.get(update.request.request_id)
            if state is None:
                continue
            try:  # one request's text failing ends that request alone
                delta_text, finished = self._advance(state, update, now)
                out = self._output(state, delta_text, update.new_token_ids, finished)
            except Exception as exc:  # noqa: BLE001 - the other requests' text goes on
                step.failed[state.request.request_id] = f"detokenizing failed: {exc}"
                state.request.finish_reason = FinishReason.ERROR
                finished = True
                out = self._failed_output(state, step.failed[state.request.request_id])
            if finished:
                state.metrics.finished_time = now
                del self._states[update.request.request_id]
                step.finished.append(state.request)
            step.outputs.append(out)
        return step

    def _failed_output(self, state: _RequestState, error: str) -> RequestOutput:
        """The last output of a request whose text could not be made: what it had so far
        (no token texts: making them may be what failed)."""
        return RequestOutput(
            **self._so_far(state), finished=True, finish_reason=FinishReason.ERROR, error=error
        )

    def _so_far(self, state: _RequestState) -> dict:
        """What every output of a request carries: its ids, text and counts so far."""
        request = state.request
        return dict(
            request_id=request.request_id,
            prompt_token_ids=request.token_ids[: request.num_prompt_tokens],
            text=state.text,
            token_ids=list(state.token_ids),
            logprobs=list(request.output_logprobs),
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_loaded_tokens=request.num_loaded_tokens,
            cache_created_tokens=created_tokens(request),
            num_kv_rows_projected=request.num_tokens_projected * self.num_layers,
            metrics=state.metrics,
        )

    def _advance(self, state: _RequestState, update: RequestUpdate, now: float) -> tuple[str, bool]:
        """Append the update's tokens; returns the new text and whether the request ended."""
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
        for token_id in update.new_token_ids:
            state.token_ids.append(token_id)
            metrics.token_times.append(now)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
        delta_text = state.text_stop.take(ended=update.finished)
        state.text += delta_text
        return delta_text, update.finished

    def _output(
        self, state: _RequestState, delta_text: str, delta_ids: list[int], finished: bool
    ) -> RequestOutput:
        request = state.request
        return RequestOutput(
            **self._so_far(state),
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            error=request.error if finished else None,
            stop_string=state.text_stop.matched if finished else None,
            delta_text=delta_text,
            delta_token_ids=list(delta_ids),
            top_logprobs=_tops(request),
            prompt_logprobs=_prompt_logprobs(request),
            token_texts=self._token_texts(state),
        )

    def _token_texts(self, state: _RequestState) -> dict[int, str] | None:
        """The text of every id the request's logprobs name, decoded once each."""
        request, params = state.request, state.request.sampling_params
        if params.logprobs is None and params.prompt_logprobs is None:
            return None
        if state.token_texts is None:
            state.token_texts = {}
            ids = set(request.token_ids[: request.num_prompt_tokens])
            for entry in request.prompt_logprobs.values():
                ids.update(t for t, _ in entry[1])
        else:
            ids = set(request.token_ids[-8:])  # (a step appends one token)
        for top in request.output_top_logprobs[-8:]:
            ids.update(t for t, _ in top)
        texts = state.token_texts
        for token_id in ids - texts.keys():
            texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return dict(texts)


def _tops(request: Request) -> list[list[tuple[int, float]]] | None:
    if request.sampling_params.logprobs is None:
        return None
    return list(request.output_top_logprobs)


def _prompt_logprobs(request: Request) -> list | None:
    """The prompt's logprobs by position (None at 0, and where none came: a position never
    computed)."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    found = request.prompt_logprobs
    return [None] + [found.get(p) for p in range(1, request.num_prompt_tokens)]

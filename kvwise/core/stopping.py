"""When a request ends, decided in one place: ``stop_reason``, which ``Scheduler.update``
calls once for every sampled token. Pure Python.

Its parts, in this order; the first that ends the request names the reason, and every part
sees every token (a grammar's state and the text the stop strings are matched in advance on
the token that another part ends the request with too):

1. the request's own limits (``limit_reason``): EOS unless ``ignore_eos``, a stop token id
   (STOP); ``max_tokens``, the model's length (LENGTH);
2. the parts the engine attached to the request (``Request.stop_parts``, ``StopPart``s):
   its grammar, complete or refusing the token — a structured output's or a tool call's
   (STOP); its stop strings, found in its text (STOP). ``engine/stop_parts.py`` has them.

A part that raises ends its request alone: ERROR, with ``Request.error`` saying which part
failed and why; the other requests go on.
"""

from __future__ import annotations

from typing import Protocol

from kvwise.core.request import Request
from kvwise.types import FinishReason


class StopPart(Protocol):
    """A part of a request's stop policy beyond its token limits, attached by the engine."""

    what: str  # names the part in an error: "the grammar", "detokenizing"

    def check(self, token_id: int) -> FinishReason | None:
        """Take the request's next sampled token; a reason when the request ends on it."""
        ...


def limit_reason(request: Request, token_id: int) -> FinishReason | None:
    """``token_id`` (appended already) ends ``request`` by its own limits?"""
    params = request.sampling_params
    if not params.ignore_eos and token_id in request.eos_token_ids:
        return FinishReason.STOP
    if token_id in params.stop_token_ids:
        return FinishReason.STOP
    if request.num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    if request.max_model_len is not None and request.num_tokens >= request.max_model_len:
        return FinishReason.LENGTH
    return None


def stop_reason(request: Request, token_id: int) -> FinishReason | None:
    """Why ``request`` ends on its newly appended ``token_id`` (None: it goes on); see the
    module docstring."""
    reason = limit_reason(request, token_id)
    for part in request.stop_parts:
        try:
            found = part.check(token_id)
        except Exception as exc:  # noqa: BLE001 - this request ends alone
            request.error = f"{part.what} failed: {exc}"
            return FinishReason.ERROR
        if reason is None:
            reason = found
    return reason

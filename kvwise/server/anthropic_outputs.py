"""Anthropic's Messages API answers: the message (``message_of``) and, streamed, its events
(``MessageEvents``), from the engine's outputs; ``anthropic_protocol.py`` holds the requests.

A message's ``content`` is its text block (when the answer has text) and a ``tool_use`` block
per call (``tools.parse_tool_calls``: id ``toolu_...``, the name, the arguments parsed as
``input``; a call cut by max_tokens is still a ``tool_use`` block, ``tools.parse_cut_answer``). ``stop_reason``: ``tool_use`` (it made calls), ``max_tokens`` (cut by max_tokens or
the context), ``stop_sequence`` (with the matched ``stop_sequence``), else ``end_turn``.
``usage``: ``input_tokens`` is the prompt's uncached rest, ``cache_read_input_tokens`` what the
engine read from its cache (the device pool or the tiers, automatic prefix caching included),
``cache_creation_input_tokens`` (by TTL in ``cache_creation``) what it wrote under
``cache_control`` breakpoints; the three add up to the prompt.

A stream, each event ``event: <type>`` and ``data: <json>``, as Anthropic sends them::

    message_start          the message, empty, with its usage so far (sent with the first
                           output, once the engine has looked the prompt up in its cache)
    ping
    content_block_start    {type: text, text: ""} or {type: tool_use, id, name, input: {}}
    content_block_delta    text_delta {text} / input_json_delta {partial_json}: the input's
                           JSON text piece by piece, as the model writes it
    content_block_stop     (a start ... stop per block, index 0, 1, ...)
    message_delta          stop_reason, stop_sequence; usage with the final output_tokens
    message_stop

An engine error mid-stream ends it with an ``error`` event instead (``dialects.ANTHROPIC``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel

from kvwise.server.cache_usage import anthropic_usage
from kvwise.server.outputs import DeltaToolCall
from kvwise.server.tools import ToolCallStream, parse_cut_answer, parse_tool_calls
from kvwise.types import FinishReason, RequestOutput


class CacheCreation(BaseModel):
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation = CacheCreation()


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextContent | ToolUseContent]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


def usage_of(out: RequestOutput, output_tokens: int | None = None) -> MessageUsage:
    """Anthropic's usage of ``out`` (``cache_usage.anthropic_usage``; ``output_tokens``: its
    tokens so far unless given)."""
    return MessageUsage.model_validate(anthropic_usage(out, output_tokens))


def stop_of(out: RequestOutput, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer (``called``: it made tool calls)."""
    if out.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if called:
        return "tool_use", None
    stop = out.stop_string
    if stop is not None:
        return "stop_sequence", stop
    return "end_turn", None


def _cut(out: RequestOutput) -> bool:
    """Cut by max_tokens (or the context): a call it was writing is a truncated tool_use
    block (its input's text so far; ``{}`` in a whole message), not text."""
    return out.finish_reason is FinishReason.LENGTH


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic spells it (``toolu_...``)."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_of(out: RequestOutput, message_id: str, model: str, names: set[str]):
    """The whole answer as a message (``names``: the tools whose calls are read)."""
    parse = parse_cut_answer if _cut(out) else parse_tool_calls
    text, calls = parse(out.text, names) if names else (out.text, [])
    content: list[TextContent | ToolUseContent] = [TextContent(text=text)] if text else []
    for call in calls:
        content.append(
            ToolUseContent(
                id=tool_use_id(call.id),
                name=call.function.name,
                input=_input(call.function.arguments),
            )
        )
    stop_reason, stop_sequence = stop_of(out, bool(calls))
    return MessageResponse(
        id=message_id,
        model=model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=usage_of(out),
    )


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event of Anthropic's (``data`` carries its ``type``)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class MessageEvents:
    """One streamed message: the engine's outputs → Anthropic's events (see the module
    docstring). With tools, a ``ToolCallStream`` reads the answer: its text goes out as it
    comes (less what may begin a call), each call as a ``tool_use`` block as soon as its name
    is complete, then its input's JSON piece by piece. ``on_tool_use`` runs once when the
    message ends in calls (the engine's tool pause)."""

    def __init__(
        self, message_id: str, model: str, names: set[str], on_tool_use: Callable[[], Any]
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.parser = ToolCallStream(names) if names else None
        self.on_tool_use = on_tool_use
        self.started = False
        self.index = -1  # the last block's
        self.open: str | None = None  # the open block's type

    def on_output(self, index: int, out: RequestOutput) -> str | None:
        events = []
        if not self.started:
            self.started = True
            message = MessageResponse(
                id=self.message_id,
                model=self.model,
                content=[],
                stop_reason=None,
                usage=usage_of(out),
            )
            events += [event("message_start", {"message": message.model_dump()}), event("ping", {})]
        text, deltas = out.delta_text, []
        if self.parser is not None:
            text, deltas = self.parser.feed(text)
            if out.finished:
                more, last = self.parser.finish(cut=_cut(out))
                text, deltas = text + more, deltas + last
        if text:
            events += self._text(text)
        for delta in deltas:
            events += self._tool_delta(delta)
        if out.finished:
            events += self._end(out)
        return "".join(events) or None

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self._stop()
        self.index += 1
        self.open = block["type"]
        return [
            *events,
            event("content_block_start", {"index": self.index, "content_block": block}),
        ]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def _text(self, text: str) -> list[str]:
        events = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _tool_delta(self, delta: DeltaToolCall) -> list[str]:
        events = []
        if delta.id is not None:  # a new call
            block = {
                "type": "tool_use",
                "id": tool_use_id(delta.id),
                "name": delta.function.name,
                "input": {},
            }
            events += self._start(block)
        if delta.function.arguments:
            events.append(
                self._delta({"type": "input_json_delta", "partial_json": delta.function.arguments})
            )
        return events

    def _end(self, out: RequestOutput) -> list[str]:
        called = bool(self.parser and self.parser.calls)
        stop_reason, stop_sequence = stop_of(out, called)
        if stop_reason == "tool_use":
            self.on_tool_use()
        usage = usage_of(out).model_dump(exclude={"cache_creation"})
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return [
            *self._stop(),
            event("message_delta", {"delta": delta, "usage": usage}),
            event("message_stop", {}),
        ]

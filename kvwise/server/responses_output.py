"""OpenAI's Responses API on the wire, the answer's side: the response object (``id``,
``status``, ``output`` items, ``usage``, the request's settings echoed, as the SDK's
``Response`` type has them) and its stream events, both written by one ``ResponseWriter``
that reads the generated text as it comes (``tools.ToolCallStream``: content, then function
calls), so that a streamed answer and a whole one are the same items.

Stream events, each with its ``sequence_number`` (no ``[DONE]``)::

    response.created, response.in_progress
    per message item:  response.output_item.added, response.content_part.added,
                       response.output_text.delta..., response.output_text.done,
                       response.content_part.done, response.output_item.done
    per function call: response.output_item.added, response.function_call_arguments.delta...,
                       response.function_call_arguments.done, response.output_item.done
    response.completed (response.incomplete when max_output_tokens cut it), with usage
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kvwise.server.responses_protocol import ResponsesRequest
from kvwise.server.tools import ToolCallStream
from kvwise.types import FinishReason, RequestOutput


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def response_head(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object's fields known before generation (the request's settings)."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt},
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "tools": [t.model_dump() for t in body.tools or ()],
        "top_logprobs": 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def usage_of(out: RequestOutput) -> dict[str, Any]:
    """Usage as Responses reports it: ``cached_tokens`` the prompt's tokens read from the
    prefix cache (full blocks), no cache writes billed (automatic caching), no reasoning."""
    num_output = len(out.token_ids)
    return {
        "input_tokens": out.num_prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": int(out.num_cached_tokens),
            "cache_write_tokens": 0,
        },
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": out.num_prompt_tokens + num_output,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item() -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [_text_part("")],
    }


class ResponseWriter:
    """One answer's output items, built from its text as it comes; with ``stream``, each step
    also written as the events above (without, the events are not written)."""

    def __init__(self, head: dict[str, Any], names: set[str], stream: bool) -> None:
        self.head = head
        self.parser = ToolCallStream(names) if names else None
        self.stream = stream
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.sequence = 0
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index → its item
        self._index: dict[str, int] = {}  # an item's id → its output_index

    # ---- events ------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        if not self.stream:
            return ""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def error(self, error) -> str:
        """The ``error`` event a failed stream ends with (an ``APIError``), numbered."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def opening(self) -> str:
        """``response.created`` and ``response.in_progress``."""
        return self._event("response.created", response=self.head) + self._event(
            "response.in_progress", response=self.head
        )

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index[item["id"]]}

    def _add(self, item: dict[str, Any]) -> str:
        self._index[item["id"]] = len(self.output)
        self.output.append(item)
        self.open = item
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        events = self._event(
            "response.output_item.added", output_index=len(self.output) - 1, item=added
        )
        if item["type"] == "message":
            events += self._event(
                "response.content_part.added",
                **self._where(item),
                content_index=0,
                part=_text_part(""),
            )
        return events

    def _close(self, status: str) -> str:
        """End the open item (``status``: completed, or incomplete when cut short)."""
        item, self.open = self.open, None
        if item is None:
            return ""
        item["status"] = status
        where = self._where(item)
        if item["type"] == "message":
            part = item["content"][0]
            events = self._event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            events += self._event("response.content_part.done", **where, content_index=0, part=part)
        else:
            events = self._event(
                "response.function_call_arguments.done", **where, arguments=item["arguments"]
            )
        return events + self._event(
            "response.output_item.done", output_index=where["output_index"], item=item
        )

    # ---- the text ----------------------------------------------------------------------------

    def _text(self, text: str) -> str:
        if not text:
            return ""
        events = ""
        if self.open is None or self.open["type"] != "message":
            events += self._close("completed") + self._add(_message_item())
        self.open["content"][0]["text"] += text
        return events + self._event(
            "response.output_text.delta",
            **self._where(self.open),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _call_deltas(self, deltas: list) -> str:
        events = ""
        for delta in deltas:
            item = self.calls.get(delta.index)
            if item is None:  # a new call: its id and name first
                events += self._close("completed")
                item = {
                    "id": f"fc_{uuid.uuid4().hex}",
                    "type": "function_call",
                    "call_id": delta.id,
                    "name": delta.function.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self.calls[delta.index] = item
                events += self._add(item)
            piece = delta.function.arguments or ""
            if piece:
                item["arguments"] += piece
                events += self._event(
                    "response.function_call_arguments.delta", **self._where(item), delta=piece
                )
        return events

    def feed(self, text: str) -> str:
        """The answer's next piece of text → its events."""
        if self.parser is None:
            return self._text(text)
        content, deltas = self.parser.feed(text)
        return self._text(content) + self._call_deltas(deltas)

    def finish(self, out: RequestOutput) -> str:
        """The answer ended: what the parser held back, and the last item closed (incomplete
        when ``max_output_tokens`` or the context cut it)."""
        events = ""
        cut = out.finish_reason == FinishReason.LENGTH
        if self.parser is not None:  # cut: a call it was writing is a (truncated) call
            content, deltas = self.parser.finish(cut=True) if cut else self.parser.finish()
            events += self._text(content) + self._call_deltas(deltas)
        if not self.output:  # an empty answer is an empty message
            events += self._add(_message_item())
        return events + self._close("incomplete" if cut else "completed")

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    # ---- the response ------------------------------------------------------------------------

    def response(self, out: RequestOutput) -> dict[str, Any]:
        """The finished response object (after ``finish``)."""
        cut = out.finish_reason == FinishReason.LENGTH
        return {
            **self.head,
            "status": "incomplete" if cut else "completed",
            "completed_at": None if cut else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": self.output,
            "usage": usage_of(out),
        }

    def closing(self, response: dict[str, Any]) -> str:
        """``response.completed`` (``response.incomplete``) with the whole response."""
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=response)

    def conversation_items(self) -> list[dict[str, Any]]:
        """The output as conversation items (``responses_protocol``'s normalized form)."""
        items = []
        for item in self.output:
            if item["type"] == "message":
                text = item["content"][0]["text"]
                items.append({"type": "message", "role": "assistant", "content": text})
            else:
                items.append(
                    {
                        "type": "function_call",
                        "call_id": item["call_id"],
                        "name": item["name"],
                        "arguments": item["arguments"],
                    }
                )
        return items

"""The agents' turns in each API kvwise serves (``kvwise bench agents --api``): the same
conversation (OpenAI-style messages with one tool, ``search``) as a Chat Completions, an
Anthropic Messages or an OpenAI Responses request, one forced call a turn, streamed; and each
dialect's stream read back into one answer: its text, its call (OpenAI's shape, which the
agent appends to its history), its usage as Chat Completions reports it (``prompt_tokens``,
``prompt_tokens_details.cached_tokens``) and when its first text or call delta arrived.

The full history is sent every turn in every API (no ``previous_response_id``), so the
prompts, the grammar and the engine's work are the same and the API layer is all that
differs."""

from __future__ import annotations

import json
import time

from kvwise.bench.common import sse_chunks

APIS = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def request_body(api: str, model: str, messages: list[dict], tool: dict, max_tokens: int) -> dict:
    """One turn's streamed request in ``api``: ``messages`` (OpenAI's shape: system, user,
    assistant with ``tool_calls``, tool) and ``tool`` (OpenAI's function tool), one call
    forced."""
    fn = tool["function"]
    if api == "chat":
        return {
            "model": model,
            "messages": messages,
            "tools": [tool],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    rest = [m for m in messages if m["role"] != "system"]
    if api == "messages":
        tools = [
            {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
        ]
        return {
            "model": model,
            "system": system,
            "messages": _anthropic(rest),
            "tools": tools,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    if api == "responses":
        tools = [{"type": "function", **fn}]
        return {
            "model": model,
            "instructions": system,
            "input": _items(rest),
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "store": False,
            "max_output_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    raise ValueError(f"api: expected one of {APIS}, got {api!r}")


def _anthropic(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if m["role"] == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": m["tool_call_id"],
                "content": m["content"],
            }
            out.append({"role": "user", "content": [block]})
        elif m.get("tool_calls"):
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [
                {
                    "type": "tool_use",
                    "id": c["id"],
                    "name": c["function"]["name"],
                    "input": _arguments(c),
                }
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def _items(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            out.append(
                {
                    "type": "function_call_output",
                    "call_id": m["tool_call_id"],
                    "output": m["content"],
                }
            )
        elif m.get("tool_calls"):
            if m.get("content"):
                out.append({"role": "assistant", "content": m["content"]})
            out += [
                {
                    "type": "function_call",
                    "call_id": c["id"],
                    "name": c["function"]["name"],
                    "arguments": c["function"]["arguments"],
                }
                for c in m["tool_calls"]
            ]
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def _arguments(call: dict) -> dict:
    try:
        value = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def streamed_answer(http, url: str, api: str, body: dict, headers: dict) -> dict:
    """A streamed answer in ``api`` reassembled: ``content``, ``calls`` (OpenAI's shape),
    ``usage`` (``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``) and ``first_s``
    (when its first text or call delta arrived)."""
    answer = _Answer()
    async with http.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {text[:300]}")
        async for event in sse_chunks(resp):
            (answer.messages if api == "messages" else answer.responses)(event)
    return answer.result()


class _Answer:
    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[dict] = []
        self.prompt = self.cached = 0
        self.first: float | None = None

    def _delta(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def _call(self, call_id: str, name: str) -> None:
        self._delta()
        self.calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        )

    def messages(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "message_start":
            usage = event["message"]["usage"]
            self.cached = usage.get("cache_read_input_tokens") or 0
            self.prompt = (
                usage["input_tokens"]
                + self.cached
                + (usage.get("cache_creation_input_tokens") or 0)
            )
        elif kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
            self._call(event["content_block"]["id"], event["content_block"]["name"])
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                self._delta()
                self.content.append(delta["text"])
            elif delta["type"] == "input_json_delta" and self.calls:
                self.calls[-1]["function"]["arguments"] += delta["partial_json"]

    def responses(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "response.output_item.added" and event["item"]["type"] == "function_call":
            self._call(event["item"]["call_id"], event["item"]["name"])
        elif kind == "response.function_call_arguments.delta" and self.calls:
            self.calls[-1]["function"]["arguments"] += event["delta"]
        elif kind == "response.output_text.delta":
            self._delta()
            self.content.append(event["delta"])
        elif kind in ("response.completed", "response.incomplete"):
            usage = event["response"].get("usage") or {}
            self.prompt = usage.get("input_tokens") or 0
            self.cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0

    def result(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }
        return {
            "content": "".join(self.content),
            "calls": self.calls,
            "usage": usage,
            "first_s": self.first or time.perf_counter(),
        }

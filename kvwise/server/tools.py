"""Tool calls on the wire: the grammar that makes ``tool_choice`` required or named hold, and
the parser that turns a model's answer into ``message.tool_calls``.

Formats read (``parse_tool_calls``): Hermes-style ``<tool_call>{"name", "arguments"}</tool_call>``
blocks (Qwen 2.5/3, SmolLM3, and what kvwise's own tools preamble asks of a model whose
template knows no tools: ``engine/chat_template.with_tools``), Llama 3.x's bare JSON object
``{"name", "parameters"}``, and a generic bare ``{"name", "arguments"}`` object. A required or
named call is decoded under a Lark grammar of ``<tool_call>`` blocks whose JSON must match the
function's parameter schema (llguidance's ``%json``), so even a small model returns a valid call.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from kvwise.server.outputs import FunctionCall, FunctionDef, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def call_grammar(functions: list[FunctionDef], named: str | None, parallel: bool) -> str:
    """A Lark grammar of one ``<tool_call>`` block (more with ``parallel``, none named) whose
    JSON is ``{"name": <a function>, "arguments": <its parameters>}``."""
    schemas = [
        {"type": "object",
         "properties": {"name": {"const": f.name},
                        "arguments": f.parameters or {"type": "object"}},
         "required": ["name", "arguments"], "additionalProperties": False}
        for f in functions if named is None or f.name == named
    ]  # fmt: skip
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # one spelling: no free whitespace, json.dumps' separators (what the next turn's prompt
    # writes back: engine/chat_template.tool_call_text)
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                            "key_separator": ": "}  # fmt: skip
    block = f"{json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}"
    more = f' ("\\n" {block})*' if parallel and named is None else ""
    return f"start: {block}{more}\ncall: %json {json.dumps(schema)}"


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=obj["name"], arguments=text))  # fmt: skip


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """The answer's content (what precedes the calls; None when nothing does) and its calls
    to functions of ``names``; ``(text, [])`` when it makes none."""
    calls: list[ToolCall] = []
    if OPEN in text:
        for body in _BLOCK.findall(text):
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is not None and call.function.name in names:
                calls.append(call)
        if calls:
            content = text[: text.index(OPEN)].strip()
            return content or None, calls
        return text, []
    stripped = text.strip()
    if stripped.startswith("{"):  # Llama 3.x / generic: the whole answer is one call
        try:
            call = _call(json.loads(stripped))
        except json.JSONDecodeError:
            call = None
        if call is not None and call.function.name in names:
            return None, [call]
    return text, []


def may_be_a_call(text: str) -> bool:
    """The answer so far could still turn into a call (a stream holds its text back)."""
    stripped = text.lstrip()
    return stripped.startswith("{") or OPEN.startswith(stripped[: len(OPEN)]) or OPEN in text

"""Tool calls on the wire: the grammar that makes ``tool_choice`` required or named hold, and
the parser that turns a model's answer into ``message.tool_calls``.

Formats read (``parse_tool_calls``): Hermes-style ``<tool_call>{"name", "arguments"}</tool_call>``
blocks (Qwen 2.5/3, SmolLM3, and what kvwise's own tools preamble asks of a model whose
template knows no tools: ``engine/chat_template.with_tools``), Llama 3.x's bare JSON object
``{"name", "parameters"}``, and a generic bare ``{"name", "arguments"}`` object. A required or
named call is decoded under a Lark grammar of ``<tool_call>`` blocks whose JSON must match the
function's parameter schema (llguidance's ``%json``), strict unless the function says
``strict: false`` (no key the schema does not name, no free whitespace: ``call_grammar``), so
even a small model returns a valid call. Every dialect's forced calls are built here.

An answer cut by ``max_tokens`` inside a call (``parse_cut_answer``, ``ToolCallStream.finish``
with ``cut``) is a truncated call, not prose: the call with its arguments' text so far (JSON
that does not parse), no content of the call's own text; the route reports ``length``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from kvwise.engine.structured import close_objects
from kvwise.server.outputs import DeltaFunction, DeltaToolCall, FunctionCall, FunctionDef, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def call_grammar(functions: list[FunctionDef], named: str | None, parallel: bool) -> str:
    """A Lark grammar of one ``<tool_call>`` block (more with ``parallel``, none named) whose
    JSON is ``{"name": <a function>, "arguments": <its parameters>}``."""
    # NOTE: each function's parameters get a base URI of their own ($id), so that their "#"
    # refs ("#/$defs/Item", as pydantic writes nested models) resolve within them, not
    # against the wrapper object this grammar puts them in
    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                "arguments": {"$id": f"urn:kvwise:tool:{f.name}", **_arguments(f)},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
        if named is None or f.name == named
    ]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # one spelling: no free whitespace, json.dumps' separators (what the next turn's prompt
    # writes back: engine/chat_template.tool_call_text)
    schema["x-guidance"] = {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
    }
    block = f"{json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}"
    more = f' ("\\n" {block})*' if parallel and named is None else ""
    return f"start: {block}{more}\ncall: %json {json.dumps(schema)}"


def _arguments(function: FunctionDef) -> dict[str, Any]:
    """The schema a call's arguments must match: the function's parameters, strict unless it
    says ``strict: false`` (``engine/structured.close_objects``: no key the schema does not
    name, at any depth; no parameters: ``{}`` only)."""
    parameters = function.parameters or {"type": "object", "properties": {}}
    if function.strict is False:
        return parameters
    if "properties" not in parameters:  # the arguments are what the schema names: none
        parameters = {**parameters, "properties": {}}
    return close_objects(parameters)


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
    return _new_call(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments)
    )


def _call_delta(index: int, call: ToolCall) -> DeltaToolCall:
    """A call's first delta in a stream: its id, name and arguments so far."""
    return DeltaToolCall(
        index=index,
        id=call.id,
        type="function",
        function=DeltaFunction(name=call.function.name, arguments=call.function.arguments),
    )


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


def parse_cut_answer(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """``parse_tool_calls`` of an answer cut by ``max_tokens``: a call it was writing is a
    call whose arguments are their text so far (``ToolCallStream.finish`` with ``cut``), what
    precedes the calls its content (None when nothing does; a call begun but naming no one
    function is dropped); ``(text, [])`` when it was writing none."""
    parser = ToolCallStream(names)
    content, _ = parser.feed(text)
    more, _ = parser.finish(cut=True)
    if not parser.calls and content + more == text:
        return text, []
    return (content + more).strip() or None, parser.calls


# a call's head cut short: {"name": "<the name, whole or begun>
_CUT_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)')


def _cut_head(rest: str, names: set[str]) -> list[ToolCall] | None:
    """The call a head cut short names (arguments ``""``): its name, complete or the only one
    that begins so (any name, when the cut came before it); none when that is no one name;
    None when ``rest`` does not begin a call's head."""
    match = _CUT_HEAD.match(rest)
    if match is None and not '{"name": "'.startswith(rest.strip()[:10]):
        return None
    begun = match.group(1) if match else ""
    try:
        begun = json.loads(f'"{begun}"')
    except json.JSONDecodeError:
        return []
    whole = match is not None and match.group(2) == '"'
    fits = [n for n in names if (n == begun if whole else n.startswith(begun))]
    return [_new_call(fits[0], "")] if len(fits) == 1 else []


# a call's head as models write it: {"name": "<name>", "arguments" (or "parameters"): <value>
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(\S)'
)
_HEAD_CHARS = 256  # a head not matched within this many characters is not streamed


class _JsonValue:
    """Where a JSON object or array ends, fed its text piece by piece (strings and their
    escapes skipped)."""

    def __init__(self) -> None:
        self.depth, self.string, self.escape = 0, False, False

    def feed(self, text: str) -> int | None:
        """Characters of ``text`` up to and including the value's end; None: not ended."""
        for i, ch in enumerate(text):
            if self.string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.string = False
            elif ch == '"':
                self.string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ToolCallStream:
    """One streamed answer's text, parsed as it comes (what ``parse_tool_calls`` reads of the
    whole): content goes out at once, less what may begin a call (a prefix of ``<tool_call>``,
    trailing whitespace); a call goes out as soon as its name is complete — its id and name,
    then its arguments' text piece by piece as the model writes it — so a client sees a call's
    first delta a few tokens in, not after its last. A call whose head does not read as
    ``{"name": .., "arguments": {..`` (another field order, an unknown function) is held and
    parsed whole at the end, as a non-streamed answer is. Grammar-constrained calls (required,
    named) always stream; a malformed call in ``auto`` streams as far as it goes and still
    ends the answer with ``tool_calls``."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.text = ""  # the answer so far
        self.done = 0  # characters of it consumed
        self.content_end = 0  # where the content sent (or dropped before a call) ends
        self.mode = "start"  # start content head args tail between after held
        self.calls: list[ToolCall] = []  # the calls sent (arguments: the text sent)
        self.bare = False  # a bare JSON call, no <tool_call> block
        self._value = _JsonValue()

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        """This piece of the answer → (content to send, tool-call deltas to send)."""
        self.text += text
        content: list[str] = []
        deltas: list[DeltaToolCall] = []
        while getattr(self, f"_{self.mode}")(self.text[self.done :], content, deltas):
            pass
        return "".join(content), deltas

    def finish(self, cut: bool = False) -> tuple[str, list[DeltaToolCall]]:
        """The answer ended: what was held back, and the calls found in it (``self.calls``).

        ``cut``: it ended at ``max_tokens``; a call it was writing is a call (its arguments'
        text so far), also one cut before its head was complete when its name is known
        (``_cut_head``), and none of the call's text is content, whole or begun."""
        rest = self.text[self.content_end :]
        if self.mode in ("start", "content"):
            self.done = len(self.text)
            if not (cut and rest.strip() and OPEN.startswith(rest.strip())):
                return rest, []
            self.mode = "head"  # a tag cut short: the call had begun
        if self.mode not in ("head", "held"):
            return "", []
        found = None
        if cut and self.mode == "head":  # the calls before this one went out whole
            head = _cut_head(self.text[self.done :], self.names)
            if head is not None or not self.bare:  # after <tool_call>: a call, even unnamed
                found = self.calls + (head or [])
        begun = found is not None
        if found is None:
            _, found = parse_tool_calls(self.text, self.names)
        if not found and not self.calls:
            return ("" if begun else rest), []
        deltas = []
        for call in found[len(self.calls) :]:
            deltas.append(_call_delta(len(self.calls), call))
            self.calls.append(call)
        return "", deltas

    # each mode: consume what it can of ``rest``; True where another mode goes on from there

    def _start(self, rest: str, content: list[str], deltas: list) -> bool:
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            self.done += len(rest) - len(stripped)
            self.content_end, self.bare, self.mode = self.done, True, "head"
        elif stripped.startswith(OPEN):
            self.content_end = self.done
            self.done += len(rest) - len(stripped) + len(OPEN)
            self.mode = "head"
        elif not stripped or OPEN.startswith(stripped):
            return False  # it may still become a call
        else:
            self.mode = "content"
        return True

    def _content(self, rest: str, content: list[str], deltas: list) -> bool:
        at = rest.find(OPEN)
        if at >= 0:
            sent = rest[:at].rstrip()
            content.append(sent)
            self.content_end = self.done + len(sent)
            self.done += at + len(OPEN)
            self.mode = "head"
            return True
        keep = next(
            (k for k in range(min(len(OPEN) - 1, len(rest)), 0, -1) if rest.endswith(OPEN[:k])), 0
        )
        sent = rest[: len(rest) - keep].rstrip()
        content.append(sent)
        self.done += len(sent)
        self.content_end = self.done
        return False

    def _head(self, rest: str, content: list[str], deltas: list) -> bool:
        match = _HEAD.match(rest)
        if match is None:
            if len(rest) > _HEAD_CHARS:
                self.mode = "held"
            return False
        try:
            name = json.loads(f'"{match.group(1)}"')
        except json.JSONDecodeError:
            name = None
        if name not in self.names or match.group(2) != "{":
            self.mode = "held"
            return False
        call = _new_call(name, "")
        deltas.append(_call_delta(len(self.calls), call))
        self.calls.append(call)
        self.done += match.start(2)
        self._value = _JsonValue()
        self.mode = "args"
        return True

    def _args(self, rest: str, content: list[str], deltas: list) -> bool:
        end = self._value.feed(rest)
        piece = rest if end is None else rest[:end]
        if piece:
            call = self.calls[-1]
            call.function.arguments += piece
            deltas.append(
                DeltaToolCall(index=len(self.calls) - 1, function=DeltaFunction(arguments=piece))
            )
        self.done += len(piece)
        if end is None:
            return False
        self.mode = "after" if self.bare else "tail"
        return True

    def _tail(self, rest: str, content: list[str], deltas: list) -> bool:
        at = rest.find(CLOSE)
        if at < 0:
            return False
        self.done += at + len(CLOSE)
        self.mode = "between"
        return True

    def _between(self, rest: str, content: list[str], deltas: list) -> bool:
        stripped = rest.lstrip()
        if stripped.startswith(OPEN):
            self.done += len(rest) - len(stripped) + len(OPEN)
            self.mode = "head"
            return True
        if stripped and not OPEN.startswith(stripped):
            self.mode = "after"  # text after the calls: dropped, as parse_tool_calls drops it
        return False

    def _after(self, rest: str, content: list[str], deltas: list) -> bool:
        self.done = len(self.text)
        return False

    def _held(self, rest: str, content: list[str], deltas: list) -> bool:
        return False

"""Anthropic's Messages API on the wire: the requests of ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, their translation into the engine's chat prompt,
``SamplingParams`` and ``RequestOptions``, and the answer's models.

The translation gives the engine the OpenAI-style messages the chat path renders with the
model's template (``protocol.ChatCompletionRequest.prompt_of``), so a conversation costs the
same tokens, and hits the same cached blocks, in either dialect::

    system (a string or text blocks)      a first "system" message
    user: text blocks                     a "user" message (a run of blocks: one message)
    user: tool_result blocks              "tool" messages (tool_call_id, the tool's name;
                                          is_error: "Error: " before the content)
    assistant: text and tool_use blocks   one "assistant" message: content, tool_calls (the
                                          input object as the call's arguments)
    tools (name, description,             function tools (parameters: input_schema)
      input_schema)
    tool_choice any / tool {name}         the required / named call's grammar
                                          (``tools.call_grammar``); none: no call is read
    max_tokens (required), stop_sequences, temperature (default 1: Anthropic's), top_p, top_k

Blocks of one message or of the system prompt are joined by a blank line. Unknown content
block types, server tools (web search, ...) and bad fields are 400s naming the field, in
Anthropic's error shape (``dialects.py``). ``metadata.user_id`` and ``thinking`` are accepted
and ignored (the tenant comes from the API key; the model does not think aloud).

``cache_control`` breakpoints are parsed here and placed and checked by
``anthropic_cache.py``. A last assistant message is continued, not answered by a new turn
(Anthropic's prefill: ``ChatPrompt.continue_final_message``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from kvwise.engine.chat_template import MAX_MESSAGES
from kvwise.engine.prompts import ChatPrompt
from kvwise.errors import InvalidRequest
from kvwise.server.anthropic_cache import CacheControl, Mark, breakpoint_prefixes, find_marks
from kvwise.server.outputs import FunctionDef
from kvwise.types import (
    MAX_KEY_CHARS,
    MAX_STOP_STRINGS,
    RequestOptions,
    SamplingParams,
    StructuredOutput,
)

MAX_TOOLS = 128
_GREEDY_TEMPERATURE = 1e-5  # below it: greedy (as the OpenAI routes)
_JOIN = "\n\n"  # between the text blocks of one message (or of the system prompt)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Wire):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1, max_length=MAX_KEY_CHARS)
    name: str = Field(..., min_length=1, max_length=128)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1, max_length=MAX_KEY_CHARS)
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self, path: str) -> str:
        """The result's text (its text blocks joined)."""
        if isinstance(self.content, str):
            return self.content
        blocks = [
            parse_block(b, f"{path}.content[{k}]", ("text",)) for k, b in enumerate(self.content)
        ]
        return _JOIN.join(b.text for b in blocks)


Block = TextBlock | ToolUseBlock | ToolResultBlock
_BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}
_ALLOWED = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


def parse_block(data: dict[str, Any], path: str, allowed: tuple[str, ...]) -> Block:
    """One content block (a 400 naming ``path`` and the field for an unknown type, a type
    not taken there or a bad field)."""
    kind = data.get("type")
    if kind not in allowed:
        raise InvalidRequest(
            f"{path}.type",
            f"content block type {kind!r} is not taken here "
            f"(this server takes {', '.join(allowed)})",
        )
    try:
        return _BLOCKS[kind].model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, path) from None


def _invalid(exc: ValidationError, path: str) -> InvalidRequest:
    """pydantic's first error as an ``InvalidRequest`` naming the field under ``path``."""
    first = exc.errors()[0]
    for part in first.get("loc", ()):
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return InvalidRequest(path, first.get("msg", "invalid"))


class InputMessage(_Wire):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolParam(_Wire):
    type: Literal["custom"] | None = Field(None, description="custom tools only")
    name: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(_Wire):
    user_id: str | None = Field(None, max_length=MAX_KEY_CHARS)


class _Conversation(_Wire):
    """What ``/v1/messages`` and its ``count_tokens`` share: the conversation and tools."""

    model: str | None = Field(None, description="the served model's name (default: it)")
    messages: list[InputMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None
    thinking: dict[str, Any] | None = Field(None, description="accepted, ignored")

    _blocks: list[list[Block]] | None = PrivateAttr(None)
    _system: list[TextBlock] | None = PrivateAttr(None)
    _cache_breakpoints: tuple = PrivateAttr(())  # set by the route (cache_usage), in tokens

    # ---- parsing and checks -------------------------------------------------------------

    def check_supported(self) -> None:
        """Parse every block and check the tools, tool_choice and breakpoints (400s naming
        the field); idempotent."""
        self._parsed()
        names = set()
        for k, tool in enumerate(self.tools or ()):
            if tool.name in names:
                raise InvalidRequest("tools", f"tool names must be unique, {tool.name!r} repeats")
            names.add(tool.name)
            kind = tool.input_schema.get("type")
            if kind != "object":
                raise InvalidRequest(
                    f"tools[{k}].input_schema",
                    f'must be a JSON Schema of "type": "object", got {kind!r}',
                )
        choice = self.tool_choice
        if choice is not None and choice.type != "none" and not self.tools:
            raise InvalidRequest("tool_choice", "needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise InvalidRequest(
                "tool_choice.name", f"must name one of the tools, got {choice.name!r}"
            )
        self._marks()
        self._check_prefill()

    def _check_prefill(self) -> None:
        """A last assistant message (a prefill) is text without trailing whitespace, as
        Anthropic requires."""
        if self.messages[-1].role != "assistant":
            return
        path = f"messages[{len(self.messages) - 1}].content"
        blocks = self._parsed()[1][-1]
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            raise InvalidRequest(path, "a final assistant message cannot hold tool_use blocks")
        text = _JOIN.join(b.text for b in blocks)
        if text != text.rstrip():
            raise InvalidRequest(
                path, "final assistant content cannot end with trailing whitespace"
            )

    def _parsed(self) -> tuple[list[TextBlock], list[list[Block]]]:
        if self._blocks is None:
            system = self.system
            if isinstance(system, str):
                system = [{"type": "text", "text": system}] if system else []
            self._system = [
                parse_block(b, f"system[{k}]", ("text",)) for k, b in enumerate(system or ())
            ]
            self._blocks = [self._message_blocks(i, m) for i, m in enumerate(self.messages)]
        return self._system or [], self._blocks

    @staticmethod
    def _message_blocks(i: int, message: InputMessage) -> list[Block]:
        if isinstance(message.content, str):
            return [TextBlock(type="text", text=message.content)]
        path = f"messages[{i}].content"
        blocks = []
        for j, data in enumerate(message.content):
            block = parse_block(data, f"{path}[{j}]", _ALLOWED[message.role])
            if isinstance(block, ToolResultBlock):
                block.text(f"{path}[{j}]")  # its content's blocks checked here too
            blocks.append(block)
        return blocks

    # ---- the engine's prompt ------------------------------------------------------------

    def prompt_of(self) -> list[dict[str, Any]] | ChatPrompt:
        """The chat prompt: the messages, with the tools when there are any (as the chat
        path gives them). A last assistant message is continued (Anthropic's prefill: the
        answer goes on from its text); an empty one opens the answer as none would."""
        messages = self.engine_messages()
        tools = self.engine_tools()
        if self.messages[-1].role == "assistant":
            if messages[-1]["content"]:
                return ChatPrompt(messages, tools, continue_final_message=True)
            messages.pop()
        return ChatPrompt(messages, tools) if tools else messages

    def engine_tools(self) -> list[dict[str, Any]] | None:
        """The tools as OpenAI function tools (what the chat template is given)."""
        if not self.tools:
            return None
        return [
            {"type": "function", "function": _function(t).model_dump(exclude_none=True)}
            for t in self.tools
        ]

    def engine_messages(self, upto: tuple[int, int] | None = None) -> list[dict[str, Any]]:
        """The conversation as chat messages; ``upto`` (i, j): only as far as block j of
        message i, that block included."""
        _, messages = self._parsed()
        out = self.system_messages()
        names = {b.id: b.name for blocks in messages for b in blocks if b.type == "tool_use"}
        last = len(messages) if upto is None else upto[0] + 1
        for i, blocks in enumerate(messages[:last]):
            if upto is not None and i == upto[0]:
                blocks = blocks[: upto[1] + 1]
            if self.messages[i].role == "assistant":
                out.append(_assistant_message(blocks))
            else:
                out += _user_messages(blocks, names, f"messages[{i}].content")
        return out

    def system_messages(self, num_blocks: int | None = None) -> list[dict[str, Any]]:
        """The system message (its first ``num_blocks`` blocks), or none."""
        system = self._parsed()[0][:num_blocks]
        return [{"role": "system", "content": _JOIN.join(b.text for b in system)}] if system else []

    def cache_breakpoint_prefixes(self) -> list[tuple[ChatPrompt, float]]:
        """Each breakpoint's conversation prefix and TTL in seconds, in prompt order
        (``anthropic_cache.breakpoint_prefixes``)."""
        return breakpoint_prefixes(self, self._marks())

    def _marks(self) -> list[Mark]:
        system, messages = self._parsed()
        return find_marks(self.tools or (), system, messages, self.cache_control)

    # ---- tools --------------------------------------------------------------------------

    def tool_names(self) -> set[str]:
        """The tools the answer may call (none with tool_choice none): its calls are read."""
        if not self.tools or (self.tool_choice and self.tool_choice.type == "none"):
            return set()
        return {t.name for t in self.tools}

    def _call_grammar(self) -> StructuredOutput | None:
        """tool_choice any / tool: a grammar that makes the answer that call."""
        choice = self.tool_choice
        if not self.tools or choice is None or choice.type not in ("any", "tool"):
            return None
        from kvwise.server.tools import call_grammar

        named = choice.name if choice.type == "tool" else None
        lark = call_grammar(
            [_function(t) for t in self.tools], named, not choice.disable_parallel_tool_use
        )
        called = [k for k, t in enumerate(self.tools) if named in (None, t.name)]
        field = f"tools[{called[0]}].input_schema" if len(called) == 1 else "tools"
        return StructuredOutput("grammar", lark, field)


def _function(tool: ToolParam) -> FunctionDef:
    # NOTE: constructed, not validated: Anthropic's names may be longer than OpenAI's 64
    return FunctionDef.model_construct(
        name=tool.name, description=tool.description, parameters=tool.input_schema
    )


def _assistant_message(blocks: list[Block]) -> dict[str, Any]:
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": _JOIN.join(texts)}
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    if calls:
        message["tool_calls"] = calls
    return message


def _user_messages(blocks: list[Block], names: dict[str, str], path: str) -> list[dict]:
    """A user turn's blocks: each tool result a "tool" message, each run of text blocks a
    "user" message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
            continue
        if texts:
            out.append({"role": "user", "content": _JOIN.join(texts)})
            texts = []
        content = block.text(f"{path}[{j}]")
        result = {
            "role": "tool",
            "content": f"Error: {content}" if block.is_error else content,
            "tool_call_id": block.tool_use_id,
        }
        if block.tool_use_id in names:
            result["name"] = names[block.tool_use_id]
        out.append(result)
    if texts or not out:
        out.append({"role": "user", "content": _JOIN.join(texts)})
    return out


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``."""


class MessagesRequest(_Conversation):
    """``POST /v1/messages``."""

    max_tokens: int = Field(..., ge=1, description="most tokens to generate (required)")
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0, le=1, description="default 1; 0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0: off")
    metadata: Metadata | None = Field(None, description="user_id: accepted, ignored")
    stream: bool = False

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters (``default_max_tokens`` unused: max_tokens is
        required)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        try:
            return SamplingParams(
                max_tokens=self.max_tokens,
                temperature=0.0 if temperature < _GREEDY_TEMPERATURE else temperature,
                top_k=self.top_k or 0,
                top_p=1.0 if self.top_p is None else self.top_p,
                stop=tuple(self.stop_sequences or ()),
                structured=self._call_grammar(),
            )
        except InvalidRequest as exc:
            raise (exc.renamed("stop_sequences") if exc.param == "stop" else exc) from None

    def request_options(self, tenant: str) -> RequestOptions:
        """The tenant comes from the API key, never the body (``metadata.user_id`` names no
        cache); its cache_control breakpoints as the route counted them in tokens."""
        return RequestOptions(tenant=tenant, cache_breakpoints=self._cache_breakpoints)

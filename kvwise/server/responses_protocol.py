"""OpenAI's Responses API on the wire, the request side: ``ResponsesRequest`` (what
``POST /v1/responses`` takes), its ``input`` checked and normalized into conversation items,
and those items translated into the chat messages the engine renders (OpenAI-style: an
assistant's ``tool_calls``, ``role: tool`` results), with the request's ``SamplingParams`` and
``RequestOptions``. The answer's side (output items, the response object, stream events) is
``responses_output.py``; the routes are ``openai_responses.py``.

Conversation items, as stored and rendered (the normalized form of every accepted input)::

    {"type": "message", "role": "user|assistant|system|developer", "content": "text"}
    {"type": "function_call", "call_id": ..., "name": ..., "arguments": "JSON text"}
    {"type": "function_call_output", "call_id": ..., "output": "text"}

Fields the server does not do are 400s naming them, unless at their neutral value
(``background: false``, ``truncation: "disabled"``, ``include: []``, ...); unknown fields are
ignored, as OpenAI's clients send many."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvwise.engine.chat_template import MAX_MESSAGES
from kvwise.engine.prompts import ChatPrompt
from kvwise.errors import InvalidRequest
from kvwise.server.outputs import FunctionCall, FunctionDef, Tool, ToolCall, call_for_template
from kvwise.server.protocol import unsupported
from kvwise.server.validation import check_tools
from kvwise.types import MAX_KEY_CHARS, RequestOptions, SamplingParams, StructuredOutput

_GREEDY_TEMPERATURE = 1e-5  # below it a temperature is greedy (as chat's)
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")
# include values that ask for nothing this server could add (it makes no reasoning items)
_HARMLESS_INCLUDES = ("reasoning.encrypted_content",)
MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata


class FunctionTool(BaseModel):
    """A function the model may call (Responses' flat shape: no ``function`` wrapper)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> Tool:
        function = FunctionDef(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            strict=self.strict,
        )
        return Tool(type="function", function=function)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields this server reads (see the module's docstring)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(None, description="the served model's name (default: it)")
    input: str | list[dict[str, Any]] = Field(
        ..., description="a user message, or items: messages, function_call, function_call_output"
    )
    instructions: str | None = Field(None, description="a system message before the input")
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description="format: text or json_schema")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    store: bool = Field(True, description="keep the response for previous_response_id and GET")
    previous_response_id: str | None = Field(None, min_length=1, max_length=MAX_KEY_CHARS)
    stream: bool = False
    prompt_cache_key: str | None = Field(None, max_length=MAX_KEY_CHARS)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, description="ignored; the tenant comes from the API key")
    safety_identifier: str | None = None
    # accepted at their neutral value only (check_supported)
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    prompt_cache_options: Any = None
    context_management: Any = None
    service_tier: str | None = None

    # ---- checks ------------------------------------------------------------------------------

    def check_supported(self) -> None:
        """Refuse what the server does not do, naming the field."""
        neutral = {
            "background": self.background in (None, False),
            "truncation": self.truncation in (None, "disabled"),
            "top_logprobs": self.top_logprobs in (None, 0),
            "max_tool_calls": self.max_tool_calls is None,
            "conversation": self.conversation is None,
            "prompt": self.prompt is None,
            "prompt_cache_options": self.prompt_cache_options is None,
            "context_management": self.context_management is None,
            "service_tier": self.service_tier in (None, "auto", "default"),
        }
        for field, ok in neutral.items():
            if not ok:
                raise unsupported(field, f"{field}={getattr(self, field)!r}")
        for i, value in enumerate(self.include or ()):
            if value not in _HARMLESS_INCLUDES:
                raise unsupported(f"include[{i}]", f"include {value!r}")
        effort = (self.reasoning or {}).get("effort")
        if effort not in (None, "none"):
            raise unsupported("reasoning.effort", f"reasoning effort {effort!r} (no reasoning)")
        self._check_metadata()
        if self.tool_choice == "required" and not self.tools:
            raise InvalidRequest("tool_choice", "required needs tools")
        try:
            check_tools([t.chat_tool() for t in self.tools or ()])
        except InvalidRequest as exc:  # named as chat's tools: tools[i].function.parameters
            raise exc.renamed(exc.param.replace(".function.", ".")) from None
        self.named_tool()
        self._text_format()

    def _check_metadata(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_KEYS:
            raise InvalidRequest(
                "metadata", f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}"
            )
        for key, value in metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise InvalidRequest("metadata", "keys of at most 64 characters, values of 512")

    def named_tool(self) -> str | None:
        """The function ``tool_choice`` names (``{"type": "function", "name"}``), or None."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return None
        name = choice.get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str) or name not in {t.name for t in self.tools or ()}:
            raise InvalidRequest(
                "tool_choice",
                "expected none, auto, required or "
                '{"type": "function", "name"} naming one of the tools',
            )
        return name

    @property
    def calls_tools(self) -> bool:
        """The answer may be function calls (tools given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_names(self) -> set[str]:
        return {t.name for t in self.tools or ()} if self.calls_tools else set()

    # ---- the engine's request ----------------------------------------------------------------

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            max_tokens=self.max_output_tokens or default_max_tokens,
            temperature=0.0 if temperature < _GREEDY_TEMPERATURE else temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            structured=self._structured(),
        )

    def request_options(self, tenant: str) -> RequestOptions:
        """The tenant from the API key; ``prompt_cache_key`` names the conversation within it
        (the engine's session id), as on chat."""
        return RequestOptions(
            tenant=tenant,
            retention="24h" if self.prompt_cache_retention == "24h" else None,
            session_id=self.prompt_cache_key or None,
        )

    def _structured(self) -> StructuredOutput | None:
        """A required or named call's grammar, else ``text.format``'s JSON schema, or None."""
        named = self.named_tool()
        if self.tools and (self.tool_choice == "required" or named):
            if self._text_format() is not None:
                raise InvalidRequest(
                    "tool_choice", "a required function call takes no json_schema text.format"
                )
            from kvwise.server.tools import call_grammar

            functions = [t.chat_tool().function for t in self.tools]
            lark = call_grammar(functions, named, self.parallel_tool_calls is not False)
            called = [i for i, t in enumerate(self.tools) if named in (None, t.name)]
            field = f"tools[{called[0]}].parameters" if len(called) == 1 else "tools"
            return StructuredOutput("grammar", lark, field)
        return self._text_format()

    def _text_format(self) -> StructuredOutput | None:
        """``text.format``: text (None), json_object or json_schema ({name, schema, strict})."""
        text = self.text or {}
        fmt = text.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise InvalidRequest("text.format", "expected an object with a type")
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutput("json", {"type": "object"}, "text.format")
        if kind != "json_schema":
            raise InvalidRequest(
                "text.format.type", f"text, json_object or json_schema, got {kind!r}"
            )
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("text.format.schema", "expected a JSON Schema object")
        if not isinstance(fmt.get("name"), str):
            raise InvalidRequest("text.format.name", "expected a string")
        return StructuredOutput("json", schema, "text.format.schema")

    # ---- the conversation --------------------------------------------------------------------

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as conversation items (400 naming ``input[i]...`` for one that is not)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        if len(self.input) > MAX_MESSAGES:
            raise InvalidRequest("input", f"at most {MAX_MESSAGES} items, got {len(self.input)}")
        return [_item(raw, f"input[{i}]") for i, raw in enumerate(self.input)]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI chat's ``{type, function}``)."""
        if not self.tools:
            return None
        return [t.chat_tool().model_dump(exclude_none=True) for t in self.tools]


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(param, f"expected a string, got {type(value).__name__}")
    return value


def _content_text(content: Any, param: str) -> str:
    """A message's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(param, "expected a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(where, "expected a content part object")
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise unsupported(
                f"{where}.type", f"content part type {kind!r} (only input_text, output_text)"
            )
        texts.append(_text(part.get("text"), f"{where}.text"))
    return "".join(texts)


def _item(raw: dict[str, Any], param: str) -> dict[str, Any]:
    """One input item, normalized (see the module's docstring)."""
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "message":
        role = raw.get("role")
        if role not in _ROLES:
            raise InvalidRequest(f"{param}.role", f"one of {', '.join(_ROLES)}, got {role!r}")
        content = _content_text(raw.get("content"), f"{param}.content")
        return {"type": "message", "role": role, "content": content}
    if kind == "function_call":
        call_id = _text(raw.get("call_id"), f"{param}.call_id")
        name = _text(raw.get("name"), f"{param}.name")
        arguments = _text(raw.get("arguments"), f"{param}.arguments")
        if not call_id or not name:
            raise InvalidRequest(f"{param}.call_id" if not call_id else f"{param}.name", "empty")
        return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
    if kind == "function_call_output":
        call_id = _text(raw.get("call_id"), f"{param}.call_id")
        output = raw.get("output")
        text = output if isinstance(output, str) else _content_text(output, f"{param}.output")
        return {"type": "function_call_output", "call_id": call_id, "output": text}
    if kind is None:
        raise InvalidRequest(
            f"{param}.type", "expected message, function_call or function_call_output"
        )
    raise unsupported(f"{param}.type", f"input item type {kind!r}")


def chat_prompt(
    items: list[dict[str, Any]], instructions: str | None, tools: list[dict[str, Any]] | None
):
    """The conversation as the engine's chat prompt: ``instructions`` a system message first,
    each ``function_call`` an assistant's tool call (merged into the assistant message just
    before it, as one turn's content and calls), each ``function_call_output`` a ``tool``
    message. 400 naming ``input`` for a result whose call is not in the conversation."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    names: dict[str, str] = {}
    merge = False  # the last message is an assistant turn a call may join
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"]})
            merge = role == "assistant"
        elif kind == "function_call":
            call = ToolCall(
                id=item["call_id"],
                function=FunctionCall(name=item["name"], arguments=item["arguments"]),
            )
            names[item["call_id"]] = item["name"]
            if not merge:
                messages.append({"role": "assistant", "content": "", "tool_calls": []})
                merge = True
            messages[-1].setdefault("tool_calls", []).append(call_for_template(call))
        else:
            if item["call_id"] not in names:
                raise InvalidRequest(
                    "input",
                    f"function_call_output for call_id "
                    f"{item['call_id']!r}: no function_call with that call_id "
                    "in the conversation",
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "name": names[item["call_id"]],
                    "content": item["output"],
                }
            )
            merge = False
    return ChatPrompt(messages, tools) if tools else messages

"""The OpenAI wire format: pydantic models of requests, responses and streamed chunks.

Requests are validated here for types and ranges (a failure becomes a 400 naming the field);
`sampling_params`, `request_options` and `prompt_of` / `messages_of` turn them into the
engine's typed inputs (`SamplingParams`, `RequestOptions`, a prompt).
Fields the engine does not implement are accepted at their neutral value and rejected with a
400 otherwise (``suffix``, ``best_of`` > 1, ...). Unknown fields are ignored, as OpenAI
clients send many.

Prompt caching: ``cache_salt`` is an extra salt *within* the caller's tenant (the tenant itself
comes from the API key, never from the body). ``prompt_cache_key`` names the conversation (the
engine's session id, scoped to the caller's tenant): ``POST /v1/kvwise/park`` with the same key
moves that conversation's KV down to the tiers between turns, and the next turn loads it back.
It never widens what may be shared. ``prompt_cache_retention`` is ``"in_memory"`` (the default
LRU) or ``"24h"`` (keep the request's cached prefix for a day, evicted only after all unkept
blocks).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvwise.engine.chat_template import MAX_MESSAGES
from kvwise.engine.prompts import ChatPrompt
from kvwise.engine.structured import open_objects
from kvwise.errors import InvalidRequest, KVWiseError
from kvwise.server.outputs import Tool, ToolCall, call_for_template
from kvwise.server.validation import (
    check_tools,
    check_unicode,  # noqa: F401 (routes imports it from here)
    logit_bias_pairs,
)
from kvwise.types import (
    MAX_KEY_CHARS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    STRUCTURED_KINDS,
    RequestOptions,
    SamplingParams,
    StructuredOutput,
)

# Below this a temperature is treated as greedy: dividing logits by a tinier one overflows.
_GREEDY_TEMPERATURE = 1e-5
_INT64 = 2**63
MAX_N = 16  # choices of one request
MAX_PROMPTS = 64  # prompts of one /v1/completions request


class APIError(Exception):
    """An error the client caused (or may retry), rendered as an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _ERROR_TYPES.get(status_code, "invalid_request_error")
        self.headers = headers or {}

    @classmethod
    def from_error(cls, exc: KVWiseError) -> APIError:
        """An engine error, by its type's status and code (and Retry-After when it has one)."""
        retry_after = getattr(exc, "retry_after_s", None)
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return cls(exc.status, str(exc), param=exc.param, code=exc.code, headers=headers)

    def body(self) -> dict[str, Any]:
        error = ErrorInfo(
            message=self.message, type=self.error_type, param=self.param, code=self.code
        )
        return ErrorResponse(error=error).model_dump()


_ERROR_TYPES = {
    401: "authentication_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what} is not supported", param=param, code="unsupported")


# ---- errors ----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(None, description="the served model's name (default: it)")
    max_tokens: int | None = Field(None, ge=1, description="most tokens to generate")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy (default 1)")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off (extension)")
    min_p: float | None = Field(None, ge=0, le=1, description="(extension)")
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64, description="reproducible sampling")
    stop: str | list[str] | None = Field(
        None, description=f"at most {MAX_STOP_STRINGS} stop strings"
    )
    stop_token_ids: list[int] | None = Field(None, description="(extension)")
    ignore_eos: bool = Field(False, description="keep generating past EOS (extension)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices, sharing the prompt's KV blocks")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="(extension)")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> [-100, 100]")
    user: str | None = Field(None, description="ignored; the tenant comes from the API key")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_KEY_CHARS,
        description="extra prompt-cache salt within the caller's tenant",
    )
    prompt_cache_key: str | None = Field(
        None,
        max_length=MAX_KEY_CHARS,
        description="names the conversation within the caller's tenant, for "
        "POST /v1/kvwise/park (never shares across tenants)",
    )
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="in_memory: default LRU; 24h: keep the cached prefix for a day"
    )
    structured_outputs: dict[str, Any] | None = Field(
        None, description="(extension) one of json (a schema), regex, grammar (Lark), choice"
    )

    def check_supported(self) -> None:
        """Refuse what the engine does not do, naming the field."""

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        return logit_bias_pairs(self.logit_bias)

    def _logprobs(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for the engine."""
        return None, None

    def _structured(self) -> StructuredOutput | None:
        """What the output must match (``structured_outputs``), or None."""
        spec = self.structured_outputs
        if not spec:
            return None
        given = [k for k in spec if spec[k] is not None]
        if len(given) != 1 or given[0] not in STRUCTURED_KINDS:
            raise InvalidRequest(
                "structured_outputs", f"exactly one of {', '.join(STRUCTURED_KINDS)}, got {given}"
            )
        kind = given[0]
        return StructuredOutput(kind, spec[kind], f"structured_outputs.{kind}")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters (InvalidRequest naming the field on a bad value)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature < _GREEDY_TEMPERATURE:
            temperature = 0.0
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        logprobs, prompt_logprobs = self._logprobs()
        max_tokens = self._max_tokens()
        return SamplingParams(
            # max_tokens 0 (completions' echo): one token is generated and dropped
            max_tokens=max(max_tokens, 1) if max_tokens is not None else default_max_tokens,
            temperature=temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            # NOTE: the engine seeds a generator with seed * 1_000_003 + i: fold to 32 bits.
            seed=None if self.seed is None else self.seed % 2**32,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=self._logit_bias(),
            structured=self._structured(),
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def request_options(self, tenant: str) -> RequestOptions:
        """How the request uses the cache; the tenant comes from the API key, never the body."""
        return RequestOptions(
            tenant=tenant,
            cache_salt=self.cache_salt,
            retention="24h" if self.prompt_cache_retention == "24h" else None,
            session_id=self.prompt_cache_key or None,  # "" names no conversation
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ...,
        description=f"a string or token ids, or a list of up to {MAX_PROMPTS} of either",
    )
    max_tokens: int | None = Field(None, ge=0, description="0: none (with echo: the prompt)")
    echo: bool = Field(
        False, description="the prompt before each choice's text (logprobs: its too)"
    )
    suffix: str | None = Field(None, description="not supported")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top k a token")
    best_of: int | None = Field(None, ge=1, description="only 1 is supported")

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise unsupported("suffix", "suffix")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"best_of={self.best_of}")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens", "0 generates nothing: only with echo")
        if self.max_tokens == 0 and self.stream:
            raise InvalidRequest("max_tokens", "0 (echo only) cannot be streamed")

    def _logprobs(self) -> tuple[int | None, int | None]:
        # echo: the prompt's logprobs (and its tokens' texts) too, every prompt row computed
        return self.logprobs, (self.logprobs or 0) if self.echo else None

    def prompts_of(self) -> list[str | list[int]]:
        """The request's prompts (one, or each of a list)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > MAX_PROMPTS:
                raise InvalidRequest("prompt", f"at most {MAX_PROMPTS} prompts, got {len(prompt)}")
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    # NOTE: the count is bounded here, so that a flood of tiny messages costs one list
    # length check, not a validation per message (or a rendering and tokenizing later)
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens")
    logprobs: bool | None = Field(None, description="each output token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="(logprobs) top k")
    tools: list[Tool] | None = Field(None, max_length=128, description="functions to call")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        None, description="none, auto (default with tools), required, or a named function"
    )
    parallel_tool_calls: bool | None = Field(None, description="several calls in one turn")
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object or json_schema ({name, schema, strict})"
    )

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise InvalidRequest("tool_choice", "needs tools")
        check_tools(self.tools)
        self.named_tool()  # a named function must be among the tools

    def named_tool(self) -> str | None:
        """The function ``tool_choice`` names, or None."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return None
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in {t.function.name for t in self.tools or ()}:
            raise InvalidRequest(
                "tool_choice", "expected {type: function, function: {name}} naming one of the tools"
            )
        return name

    @property
    def calls_tools(self) -> bool:
        """The answer may be tool calls (tools given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _logprobs(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def _structured(self) -> StructuredOutput | None:
        """A required or named tool call's grammar, else ``response_format`` (json_object,
        json_schema), else ``structured_outputs``."""
        if self.tools and (self.tool_choice == "required" or self.named_tool()):
            if self.response_format or self.structured_outputs:
                raise InvalidRequest("tool_choice", "a required tool call takes no response_format")
            from kvwise.server.tools import call_grammar

            named = self.named_tool()
            lark = call_grammar(
                [t.function for t in self.tools], named, self.parallel_tool_calls is not False
            )
            called = [i for i, t in enumerate(self.tools) if named in (None, t.function.name)]
            # a grammar of one function's schema: its errors are that schema's
            field = f"tools[{called[0]}].function.parameters" if len(called) == 1 else "tools"
            return StructuredOutput("grammar", lark, field)
        fmt = self.response_format
        kind = (fmt or {}).get("type", "text")
        if kind == "text":
            return super()._structured()
        if self.structured_outputs:
            raise InvalidRequest("structured_outputs", "not with a structured response_format")
        if kind == "json_object":
            return StructuredOutput("json", {"type": "object"}, "response_format")
        if kind != "json_schema":
            raise InvalidRequest(
                "response_format", f"type must be text, json_object or json_schema, got {kind!r}"
            )
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest("response_format.json_schema", "expected {name, schema, strict}")
        schema_field = "response_format.json_schema.schema"
        schema = spec.get("schema", {})
        if spec.get("strict") is False:  # other keys admitted (strict is the default)
            schema = open_objects(schema)
        return StructuredOutput("json", schema, schema_field)

    def prompt_of(self):
        """The chat prompt: the messages, with the tools when there are any."""
        messages = self.messages_of()
        if not self.tools:
            return messages
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        return ChatPrompt(messages, tools)

    def messages_of(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: str role and str content, and an
        assistant's ``tool_calls`` (arguments as objects, as templates write them) and a tool
        result's ``tool_call_id``."""
        out = []
        for i, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        param = f"messages[{i}].content[{j}]"
                        raise unsupported(param, f"content part type {part.type!r} (only text)")
                    texts.append(part.text)
                content = "".join(texts)
            role = "system" if message.role == "developer" else message.role
            entry: dict[str, Any] = {"role": role, "content": content or ""}
            if message.tool_calls:
                entry["tool_calls"] = [call_for_template(c) for c in message.tool_calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            if message.name is not None and role == "tool":
                entry["name"] = message.name
            out.append(entry)
        return out


class ParkRequest(BaseModel):
    """``POST /v1/kvwise/park`` (extension)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt_cache_key: str = Field(
        ...,
        min_length=1,
        max_length=MAX_KEY_CHARS,
        description="the conversation whose KV to move to the tiers",
    )

"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, over the engine's
``tokenize`` / ``detokenize`` (on its tokenizer threads, never the event loop):

- ``/tokenize`` ``{"model"?, "prompt": "text"}`` or ``{"model"?, "messages": [...], "tools"?,
  "add_generation_prompt"?: true}`` → ``{"count", "max_model_len", "tokens"}``: the ids the
  engine would run (chat messages rendered with the model's template as
  ``/v1/chat/completions`` renders them, with the caller's tenant's recent answers);
- ``/detokenize`` ``{"model"?, "tokens": [ids]}`` → ``{"prompt": "text"}`` (special tokens
  written out); an id outside the vocabulary is a 400 naming ``tokens``.

Both need the API key as the /v1 routes do (``transport.AuthAndCount``); errors in OpenAI's
shape.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from kvwise.engine.chat_template import MAX_MESSAGES
from kvwise.engine.prompts import ChatPrompt
from kvwise.errors import InvalidRequest
from kvwise.server.generation import Generation, ServerContext
from kvwise.server.outputs import Tool
from kvwise.server.protocol import ChatCompletionRequest, ChatMessage
from kvwise.server.validation import check_unicode


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(None, description="the served model's name (default: it)")
    prompt: str | None = Field(None, description="text (or messages, not both)")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(None, max_length=128, description="with messages")
    add_generation_prompt: bool = Field(True, description="with messages: open the answer")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerRoutes:
    def __init__(self, gen: Generation) -> None:
        self.gen = gen

    async def tokenize(self, body: TokenizeRequest, request: Request) -> TokenizeResponse:
        check_unicode(body, await request.body())
        self.gen.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("prompt", "expected either prompt (text) or messages")
        if body.messages is None:
            prompt, param = body.prompt, "prompt"
        else:
            chat = ChatCompletionRequest(messages=body.messages, tools=body.tools)
            chat.check_supported()
            tools = [t.model_dump(exclude_none=True) for t in body.tools or ()] or None
            prompt = ChatPrompt(chat.messages_of(), tools, body.add_generation_prompt)
            param = "messages"
        try:
            token_ids = await self.gen.engine.tokenize(prompt, request.state.tenant)
        except InvalidRequest as exc:
            raise (exc.renamed(param) if exc.param in ("prompt", "messages") else exc) from None
        max_model_len = self.gen.engine.max_model_len
        return TokenizeResponse(count=len(token_ids), max_model_len=max_model_len, tokens=token_ids)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.gen.check_model(body.model)
        try:
            text = await self.gen.engine.detokenize(body.tokens)
        except InvalidRequest as exc:
            raise (exc.renamed("tokens") if exc.param == "token_ids" else exc) from None
        return DetokenizeResponse(prompt=text)


def add_routes(app: FastAPI, context: ServerContext) -> None:
    """Register ``POST /tokenize`` and ``POST /detokenize``."""
    routes = TokenizerRoutes(context.gen)
    app.post("/tokenize", response_model=TokenizeResponse)(routes.tokenize)
    app.post("/detokenize", response_model=DetokenizeResponse)(routes.detokenize)

"""The API dialects the server speaks, as far as the API-neutral layer needs to know them: how
an error is written (a JSON body, a stream event) and how a stream ends.

Every path belongs to one dialect by its prefix (``dialect_for``): ``/v1/messages`` is
Anthropic's Messages API, ``/v1/responses`` OpenAI's Responses API, anything else OpenAI's
Chat Completions / Completions shape. The middleware (401, 413, 421, 429), the app's error
handlers and the streams all answer in the dialect of the path the client called, so a client
library parses every error it can get, an unknown route included.

::

    dialect     error body                                         stream error, end
    openai      {"error": {message, type, param, code}}            data: {error}  data: [DONE]
    responses   {"error": {message, type, param, code}}            event: error (type, code,
                                                                    message, param), no [DONE]
    anthropic   {"type": "error", "error": {type, message}}        event: error, no [DONE]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from kvwise.server.protocol import APIError

# Anthropic's error types by status (its API reference, "Errors")
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def _openai_body(error: APIError) -> dict[str, Any]:
    return error.body()


def _anthropic_body(error: APIError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status_code)
    if kind is None:
        kind = "api_error" if error.status_code >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _openai_stream_error(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


def _anthropic_stream_error(error: APIError) -> str:
    return f"event: error\ndata: {json.dumps(_anthropic_body(error))}\n\n"


def _responses_stream_error(error: APIError) -> str:
    body = {
        "type": "error",
        "code": error.code,
        "message": error.message,
        "param": error.param,
    }
    return f"event: error\ndata: {json.dumps(body)}\n\n"


@dataclass(frozen=True)
class Dialect:
    """One API's way of writing errors and ending streams."""

    name: str
    error_body: Callable[[APIError], dict[str, Any]]
    stream_error: Callable[[APIError], str]  # one server-sent event
    stream_end: str  # sent after a stream's last event ("" for none)

    def error_response(self, error: APIError, headers: dict[str, str] | None = None):
        """``error`` as a JSON response (its own headers, then ``headers``)."""
        return JSONResponse(
            self.error_body(error),
            status_code=error.status_code,
            headers={**error.headers, **(headers or {})},
        )


OPENAI = Dialect("openai", _openai_body, _openai_stream_error, "data: [DONE]\n\n")
RESPONSES = Dialect("responses", _openai_body, _responses_stream_error, "")
ANTHROPIC = Dialect("anthropic", _anthropic_body, _anthropic_stream_error, "")

_PREFIXES = (("/v1/messages", ANTHROPIC), ("/v1/responses", RESPONSES))


def dialect_for(path: str) -> Dialect:
    """The dialect a path belongs to (by prefix; OpenAI's for any other)."""
    for prefix, dialect in _PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return dialect
    return OPENAI


def error_response(scope_or_path, error: APIError, headers: dict[str, str] | None = None):
    """``error`` as a JSON response in the dialect of the request's path (an ASGI scope, a
    starlette ``Request`` or the path itself)."""
    if isinstance(scope_or_path, str):
        path = scope_or_path
    elif isinstance(scope_or_path, dict):
        path = scope_or_path.get("path", "")
    else:
        path = scope_or_path.url.path
    return dialect_for(path).error_response(error, headers)

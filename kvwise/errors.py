"""Errors a caller can act on, each carrying the HTTP status the server answers with.

The engine raises these; the server turns one into an OpenAI error body by its attributes
(``status``, ``code``, ``param``), never by its message. ``InvalidRequest`` and its kinds are
``ValueError``s, so offline callers can keep catching ``ValueError``; their message starts with
the field they name (``"prompt: ..."``).
"""

from __future__ import annotations


class KVWiseError(Exception):
    """Base class. ``status``: the HTTP status; ``code``: OpenAI's error code (or None)."""

    status: int = 500
    code: str | None = None
    param: str | None = None


class InvalidRequest(KVWiseError, ValueError):
    """Bad input, naming the field: ``InvalidRequest("temperature", "must be >= 0")``."""

    status = 400

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.detail = message

    def renamed(self, param: str) -> InvalidRequest:
        """The same error naming the field as the client sent it (e.g. ``messages``)."""
        return type(self)(param, self.detail)


class ContextLengthExceeded(InvalidRequest):
    """The prompt does not fit the model's context or the KV cache."""

    code = "context_length_exceeded"


class SessionNotFound(InvalidRequest):
    status = 404
    code = "session_not_found"


class SessionBusy(InvalidRequest):
    status = 409
    code = "session_busy"


class QueueFullError(KVWiseError, OverflowError):
    """The waiting queue is full: retry after ``retry_after_s`` seconds."""

    status = 429
    code = "queue_full"

    def __init__(self, retry_after_s: int = 1) -> None:
        super().__init__(f"the server is busy (waiting queue full); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class GrammarBusy(KVWiseError, OverflowError):
    """Every grammar compile slot open to this caller stayed taken until its deadline (one
    tenant's compiles are capped, ``--grammar-compiles-per-tenant``): retry later."""

    status = 429
    code = "grammar_busy"

    def __init__(self, param: str, retry_after_s: int = 1) -> None:
        super().__init__(
            f"{param}: the server is compiling other constraints (of yours, or every worker "
            f"is busy); retry after {retry_after_s} s"
        )
        self.param = param
        self.retry_after_s = retry_after_s


class EngineDeadError(KVWiseError, RuntimeError):
    """The engine loop is not running (shut down, or broken by a failed step)."""

    status = 503
    code = "engine_down"


class EngineStepError(KVWiseError, RuntimeError):
    """A step failed while this request was in flight; the request was aborted."""

    status = 500
    code = "engine_error"


class ReplicaFailedError(KVWiseError, RuntimeError):
    """The replica serving this request failed or went away (scale-out); retrying the request
    sends it to a live one."""

    status = 503
    code = "replica_unavailable"
    retry_after_s = 1

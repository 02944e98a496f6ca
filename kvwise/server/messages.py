"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over
the API-neutral ``generation.Generation``: to come (issue 46, item 1)."""

from __future__ import annotations

from fastapi import FastAPI

from kvwise.server.generation import ServerContext


def add_routes(app: FastAPI, context: ServerContext) -> None:
    """Register the Messages routes (none yet)."""

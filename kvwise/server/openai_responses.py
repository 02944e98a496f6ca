"""OpenAI's Responses API (``/v1/responses``) over the API-neutral ``generation.Generation``:
to come (issue 46, item 3)."""

from __future__ import annotations

from fastapi import FastAPI

from kvwise.server.generation import ServerContext


def add_routes(app: FastAPI, context: ServerContext) -> None:
    """Register the Responses routes (none yet)."""

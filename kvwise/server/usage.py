"""A bill per tenant (``GET /v1/usage``, admin only): to come (issue 46, item 5)."""

from __future__ import annotations

from fastapi import FastAPI

from kvwise.server.generation import ServerContext


def add_routes(app: FastAPI, context: ServerContext) -> None:
    """Register the usage routes (none yet)."""

"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: to come (issue 46, item 6)."""

from __future__ import annotations

from fastapi import FastAPI

from kvwise.server.generation import ServerContext


def add_routes(app: FastAPI, context: ServerContext) -> None:
    """Register the tokenizer routes (none yet)."""

"""The OpenAI-compatible HTTP server (the only layer that sees JSON): ``kvwise serve``."""

from kvwise.server.app import create_app
from kvwise.server.transport import parse_api_keys

__all__ = ["create_app", "parse_api_keys"]

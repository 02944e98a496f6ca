"""Fixtures shared by the tokenizer tests: the default model's GGUF and its tokenizer."""

from __future__ import annotations

import pytest

from kvwise.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def gguf_path():
    from kvwise.models.default import default_model_path

    try:
        return default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.from_path(gguf_path)

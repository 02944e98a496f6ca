"""A text prompt that tokenizes to nothing is a 400 naming ``prompt`` (the default model's
GGUF vocabulary has no token for some control characters: the fuzzer sent "\\x14"), never a
ValueError from deep in the engine (a 500)."""

from __future__ import annotations

import pytest

from kvwise.engine.prompts import tokenize_prompt
from kvwise.errors import InvalidRequest


class _Tokenizer:
    max_token_chars = 64

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text if c.isprintable()]


def test_a_text_that_tokenizes_to_nothing_is_refused_naming_the_prompt():
    with pytest.raises(InvalidRequest) as caught:
        tokenize_prompt(_Tokenizer(), "\x14\x17", vocab_size=256)
    assert caught.value.param == "prompt"
    assert tokenize_prompt(_Tokenizer(), "a\x14", vocab_size=256) == [ord("a")]

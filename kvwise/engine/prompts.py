"""The prompt forms the engine takes (a string, chat messages, token ids) and what it needs
from a tokenizer to turn them into token ids. No torch."""

from __future__ import annotations

from typing import Protocol

from kvwise.engine.detokenize import Decoder
from kvwise.errors import InvalidRequest

Prompt = str | list[dict] | list[int]


class Tokenizer(Decoder, Protocol):
    """What the engine needs from a tokenizer (``engine.tokenizer.Tokenizer`` fits)."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]: ...


def tokenize_prompt(tokenizer: Tokenizer, prompt: Prompt, vocab_size: int) -> list[int]:
    """A string, a chat message list or token ids → token ids (InvalidRequest on bad input)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return tokenizer.encode_chat(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest("prompt", f"token ids must be in [0, {vocab_size}), got {bad[:5]}")
        return list(prompt)
    raise InvalidRequest(
        "prompt", "expected a non-empty string, a list of chat messages or a list of token ids"
    )

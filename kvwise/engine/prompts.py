"""The prompt forms the engine takes (a string, chat messages, token ids) and what it needs
from a tokenizer to turn them into token ids. No torch."""

from __future__ import annotations

from typing import Protocol

from kvwise.engine.detokenize import Decoder
from kvwise.errors import ContextLengthExceeded, InvalidRequest

Prompt = str | list[dict] | list[int]


class Tokenizer(Decoder, Protocol):
    """What the engine needs from a tokenizer (``engine.tokenizer.Tokenizer`` fits)."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]: ...


def tokenize_prompt(
    tokenizer: Tokenizer, prompt: Prompt, vocab_size: int, max_tokens: int | None = None
) -> list[int]:
    """A string, a chat message list or token ids → token ids (InvalidRequest on bad input).

    ``max_tokens``: text longer than that many tokens could stand for
    (``tokenizer.max_token_chars`` each) is refused before it is tokenized, so a huge prompt
    costs nothing to turn away (``ContextLengthExceeded``)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        _check_length(tokenizer, "prompt", len(prompt), max_tokens)
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        # the rendered chat holds at least every message's text
        num_chars = sum(len(m["content"]) for m in prompt if isinstance(m.get("content"), str))
        _check_length(tokenizer, "messages", num_chars, max_tokens)
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


def _check_length(tokenizer: Tokenizer, field: str, num_chars: int, max_tokens: int | None):
    if max_tokens is None:
        return
    limit = max_tokens * tokenizer.max_token_chars
    if num_chars > limit:
        raise ContextLengthExceeded(
            field,
            f"{num_chars} characters are more than the model's context of {max_tokens} tokens "
            f"can hold (a token stands for at most {tokenizer.max_token_chars} characters)",
        )

"""The prompt forms the engine takes (a string, chat messages, token ids) and what it needs
from a tokenizer to turn them into token ids. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvwise.engine.chat_template import MAX_MESSAGES
from kvwise.engine.detokenize import Decoder
from kvwise.errors import ContextLengthExceeded, InvalidRequest


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt already turned into checked token ids by ``tokenize_prompt`` (on another
    thread: the engine then does no tokenizing work for it)."""

    token_ids: tuple[int, ...]


Prompt = str | list[dict] | list[int] | TokenizedPrompt


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
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        max_chars: int | None = None,
    ) -> list[int]:
        """The rendered chat's ids; a rendering over ``max_chars`` characters is refused
        before it is tokenized (``ContextLengthExceeded``)."""
        ...


def tokenize_prompt(
    tokenizer: Tokenizer, prompt: Prompt, vocab_size: int, max_tokens: int | None = None
) -> list[int]:
    """A string, a chat message list or token ids → token ids (InvalidRequest on bad input).

    Thread-safe (it only reads the tokenizer), so it can run off the engine thread.

    ``max_tokens``: text longer than that many tokens could stand for
    (``tokenizer.max_token_chars`` each) is refused before it is tokenized, so a huge prompt
    costs nothing to turn away (``ContextLengthExceeded``); so is a chat of more than
    ``MAX_MESSAGES`` messages, before it is rendered, and one whose rendering is that long,
    before it is tokenized. Token ids beyond ``max_tokens`` are refused before they are
    checked one by one."""
    if isinstance(prompt, TokenizedPrompt):
        return list(prompt.token_ids)
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        _check_length(tokenizer, "prompt", len(prompt), max_tokens)
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        if len(prompt) > MAX_MESSAGES:
            raise InvalidRequest(
                "messages", f"at most {MAX_MESSAGES} messages in one request, got {len(prompt)}"
            )
        if not all(isinstance(m, dict) for m in prompt):
            raise InvalidRequest("messages", "expected a list of {role, content} dicts")
        # the rendered chat holds at least every message's text
        num_chars = sum(len(m["content"]) for m in prompt if isinstance(m.get("content"), str))
        _check_length(tokenizer, "messages", num_chars, max_tokens)
        max_chars = None if max_tokens is None else max_tokens * tokenizer.max_token_chars
        return tokenizer.encode_chat(prompt, max_chars=max_chars)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if max_tokens is not None and len(prompt) > max_tokens:
            raise ContextLengthExceeded(
                "prompt",
                f"{len(prompt)} tokens do not fit the model's context of {max_tokens} tokens",
            )
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

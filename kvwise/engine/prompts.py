"""The prompt forms the engine takes (a string, chat messages, token ids) and what it needs
from a tokenizer to turn them into token ids. No torch."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages with the tools the model may call (OpenAI's function ``tools``, passed to
    the chat template as its ``tools`` variable; a template without one gets them described in
    a system message, ``chat_template.with_tools``). Messages may hold assistant ``tool_calls``
    and ``tool`` results. ``add_generation_prompt``: end with the header that opens the
    assistant's turn (False: the chat as it stands, e.g. to count or cache a prefix of it);
    ``continue_final_message``: leave the last message open, for the model to continue it
    (an assistant's prefill)."""

    messages: list[dict]
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


Prompt = str | list[dict] | list[int] | TokenizedPrompt | ChatPrompt


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
        tools: list[dict] | None = None,
        answers: Callable[[str], Sequence[int] | None] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The rendered chat's ids; a rendering over ``max_chars`` characters is refused
        before it is tokenized (``ContextLengthExceeded``); ``continue_final_message``: the
        last message left open (cut after its content)."""
        ...


class RecentAnswers:
    """The token ids of recent answers by their text, per tenant (bounded, least recently
    used out first; thread-safe): a chat prompt that repeats an answer as an assistant
    message gets the ids the model generated, not a new tokenization of the text
    (``Tokenizer.encode_chat``), so the next turn of a conversation hits the blocks its last
    turn cached. Per tenant: which ids a text gets (its prompt's length) never depends on
    another tenant's answers."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, tenant: str, text: str, token_ids: Sequence[int]) -> None:
        if not text or not token_ids:
            return
        with self._lock:
            self._ids[(tenant, text)] = tuple(token_ids)
            self._ids.move_to_end((tenant, text))
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def lookup(self, tenant: str) -> Callable[[str], Sequence[int] | None]:
        def find(text: str) -> Sequence[int] | None:
            with self._lock:
                return self._ids.get((tenant, text))

        return find


def tokenize_prompt(
    tokenizer: Tokenizer,
    prompt: Prompt,
    vocab_size: int,
    max_tokens: int | None = None,
    answers: Callable[[str], Sequence[int] | None] | None = None,
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
    tools, extra = None, {}
    if isinstance(prompt, ChatPrompt):
        if not prompt.add_generation_prompt:
            extra["add_generation_prompt"] = False
        if prompt.continue_final_message:
            extra["continue_final_message"] = True
        prompt, tools = prompt.messages, prompt.tools
        if not prompt:
            raise InvalidRequest("messages", "expected a non-empty list of messages")
    if isinstance(prompt, str):
        return _encode_text(tokenizer, prompt, max_tokens)
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
        extra.update((k, v) for k, v in (("tools", tools), ("answers", answers)) if v)
        return tokenizer.encode_chat(prompt, max_chars=max_chars, **extra)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        if max_tokens is not None and len(prompt) > max_tokens:  # before a look at each id
            raise ContextLengthExceeded(
                "prompt",
                f"{len(prompt)} tokens do not fit the model's context of {max_tokens} tokens",
            )
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest(
                    "prompt", f"token ids must be in [0, {vocab_size}), got {bad[:5]}"
                )
            return list(prompt)
    raise InvalidRequest(
        "prompt", "expected a non-empty string, a list of chat messages or a list of token ids"
    )


def detokenize_ids(tokenizer: Tokenizer, token_ids: Sequence[int], vocab_size: int) -> str:
    """The text of ``token_ids``, special tokens included (``/detokenize``); an id that is
    no int in ``[0, vocab_size)`` is an ``InvalidRequest`` naming ``token_ids``. Thread-safe
    (it only reads the tokenizer)."""
    bad = [t for t in token_ids if not _is_token_id(t, vocab_size)]
    if bad:
        raise InvalidRequest("token_ids", f"must be in [0, {vocab_size}), got {bad[:5]}")
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _encode_text(tokenizer: Tokenizer, text: str, max_tokens: int | None) -> list[int]:
    if not text:
        raise InvalidRequest("prompt", "must not be empty")
    _check_length(tokenizer, "prompt", len(text), max_tokens)
    ids = tokenizer.encode(text)
    if not ids:  # e.g. control characters a GGUF's vocabulary has no token for
        raise InvalidRequest("prompt", "the text tokenizes to no tokens")
    return ids


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

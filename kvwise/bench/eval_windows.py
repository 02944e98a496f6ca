"""The text ``kvwise eval`` reads, its tokens, and the windows it reads them in (pure Python;
the windows' diagrams are in ``bench/evaluate.py``).

Two window plans (``WINDOW_MODES``):

- ``sliding`` (the default): windows of ``ctx`` tokens every ``stride`` tokens, each token scored
  once, by the first window that holds it with context before it (``plan_windows``);
- ``llama.cpp``: what ``llama-perplexity`` (and its ``--kl-divergence``) scores: chunks of
  ``ctx`` tokens end to end, the tail that fills no chunk dropped, each chunk scoring its
  tokens ``[ctx // 2 + 1, ctx)`` (``plan_chunks``), over the token stream ``llama_cpp_tokens``
  builds (the text less one trailing newline, BOS first when the model adds one, and each
  chunk's first token replaced by BOS).
"""

from __future__ import annotations

import hashlib
import platform
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

WINDOW_MODES = ("sliding", "llama.cpp")


@dataclass(frozen=True)
class Corpus:
    """The text evaluated and what identifies it (the sha256 of its UTF-8 bytes)."""

    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @classmethod
    def default(cls) -> Corpus:
        """The language reference that ships with the interpreter (``pydoc_data.topics``),
        topics joined in sorted key order: real text we did not write, fixed for a given
        Python version."""
        from pydoc_data.topics import topics

        text = "".join(topics[key] for key in sorted(topics))
        return cls(f"pydoc_data.topics (Python {platform.python_version()})", text)

    @classmethod
    def from_file(cls, path: str | Path) -> Corpus:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"text: cannot read '{path}' as UTF-8 text: {e}") from None
        return cls(str(path), text)


@dataclass(frozen=True)
class Window:
    """Tokens ``[start, end)`` run through the model; those in ``[first_scored, end)`` are scored
    (predicted from the window's tokens before them)."""

    start: int
    end: int
    first_scored: int

    @property
    def num_scored(self) -> int:
        return self.end - self.first_scored


def default_stride(windows: str, ctx: int) -> int:
    """``ctx // 2`` for sliding windows; ``ctx`` for llama.cpp's chunks (they do not overlap)."""
    return ctx if windows == "llama.cpp" else ctx // 2


def check_window_settings(
    ctx: int, stride: int, max_windows: int | None, windows: str = "sliding"
) -> None:
    """Raise ValueError unless ``windows`` is a mode of ``WINDOW_MODES``, ``ctx >= 2``,
    ``1 <= stride <= ctx`` (``stride == ctx`` for llama.cpp's chunks) and ``max_windows`` is
    None or positive."""
    if windows not in WINDOW_MODES:
        raise ValueError(f"windows: expected one of {WINDOW_MODES}, got {windows!r}")
    if windows == "llama.cpp" and stride != ctx:
        raise ValueError(
            f"stride: llama.cpp's chunks follow each other (stride = ctx = {ctx}), got {stride}"
        )
    if ctx < 2:
        raise ValueError(f"ctx: must be at least 2 tokens, got {ctx}")
    if not 1 <= stride <= ctx:
        raise ValueError(f"stride: must be between 1 and ctx ({ctx}), got {stride}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows: must be at least 1, got {max_windows}")


def plan_windows(
    num_tokens: int, ctx: int, stride: int, max_windows: int | None = None
) -> list[Window]:
    """The sliding windows over ``num_tokens`` tokens (see the module docstring).

    Raises:
        ValueError: bad settings (``check_window_settings``) or fewer than two tokens.
    """
    check_window_settings(ctx, stride, max_windows)
    if num_tokens < 2:
        raise ValueError(f"text: {num_tokens} tokens; need at least 2 to score one")
    windows: list[Window] = []
    num_scored_tokens = 0  # tokens [0, num_scored_tokens) are scored or context-only already
    start = 0
    while True:
        end = min(start + ctx, num_tokens)
        first_scored = max(num_scored_tokens, start + 1)
        if first_scored < end:
            windows.append(Window(start, end, first_scored))
        num_scored_tokens = end
        if end == num_tokens or len(windows) == max_windows:
            return windows
        start += stride


def plan_chunks(num_tokens: int, ctx: int, max_windows: int | None = None) -> list[Window]:
    """llama-perplexity's windows: chunk ``i`` is tokens ``[i * ctx, (i + 1) * ctx)`` for every
    chunk the text fills (at most ``max_windows``, its ``--chunks``), scoring tokens from
    ``ctx // 2 + 1`` on (llama.cpp reads the logits of positions ``ctx // 2`` to ``ctx - 2``).

    Raises:
        ValueError: bad settings, or fewer tokens than one chunk.
    """
    check_window_settings(ctx, ctx, max_windows, "llama.cpp")
    num_chunks = num_tokens // ctx
    if num_chunks < 1:
        raise ValueError(
            f"text: {num_tokens} tokens; llama.cpp's windows need a chunk of "
            f"ctx = {ctx} (llama-perplexity itself asks for 2 x ctx)"
        )
    if max_windows is not None:
        num_chunks = min(num_chunks, max_windows)
    first = ctx // 2 + 1
    return [Window(i * ctx, (i + 1) * ctx, i * ctx + first) for i in range(num_chunks)]


def plan(
    windows: str, num_tokens: int, ctx: int, stride: int, max_windows: int | None = None
) -> list[Window]:
    """The windows of mode ``windows`` (``plan_windows`` or ``plan_chunks``)."""
    check_window_settings(ctx, stride, max_windows, windows)
    if windows == "llama.cpp":
        return plan_chunks(num_tokens, ctx, max_windows)
    return plan_windows(num_tokens, ctx, stride, max_windows)


class TextTokenizer(Protocol):
    """What the eval needs of a tokenizer (``engine.tokenizer.Tokenizer`` has it)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def id_to_token(self, token_id: int) -> str | None: ...


def llama_cpp_tokens(tokenizer: TextTokenizer, text: str) -> tuple[list[int], int | None]:
    """The token stream llama-perplexity scores and the id each chunk starts with.

    ``-f FILE`` drops one trailing newline, then the text is tokenized with the model's special
    tokens (BOS first when the model adds one). Returns ``(token_ids, chunk_bos_id)``:
    ``chunk_bos_id`` is the BOS id that replaces every chunk's first token, or None when the
    model adds no BOS.

    NOTE: llama.cpp reads special tokens written in the text as plain text; kvwise's tokenizer
    reads them as their ids. A text that spells one (``<|im_start|>``) gives other tokens here:
    ``scripts/llamacpp_kld.py --check-tokens`` compares the two streams.
    """
    text = text[:-1] if text.endswith("\n") else text
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("", add_special_tokens=True)[:1] == [bos]
    return ids, (bos if adds_bos else None)


def token_ids_sha256(token_ids: Sequence[int]) -> str:
    """sha256 of the ids as int32 little-endian: the bytes llama-perplexity writes into its
    ``--kl-divergence-base`` file (the tokens of the chunks it reads)."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}i", *token_ids)).hexdigest()


def vocabulary_mismatch(tokenizer: TextTokenizer, other: TextTokenizer) -> str | None:
    """How two tokenizers' vocabularies differ (their sizes, or the first id whose token
    strings differ), or None when every id spells the same token."""
    if tokenizer.vocab_size != other.vocab_size:
        return (
            f"a vocabulary of {other.vocab_size} tokens, the candidate's has {tokenizer.vocab_size}"
        )
    for token_id in range(tokenizer.vocab_size):
        mine, theirs = tokenizer.id_to_token(token_id), other.id_to_token(token_id)
        if mine != theirs:
            return f"token {token_id} is {theirs!r}, the candidate's {mine!r}"
    return None

"""Streaming output text: token ids -> text deltas, and stop strings. No torch here.

`IncrementalDetokenizer` turns ids, one at a time, into text deltas whose concatenation (after
`flush`) equals ``tokenizer.decode(all_ids)``. It decodes a short window of ids, as vLLM and
transformers' TextStreamer do:

    ids:   ... | already emitted, context | pending (not yet emitted) |
               ^ prefix_offset            ^ read_offset                ^ len(ids)

    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Decoding from `prefix_offset` rather than `read_offset` keeps decoders that look at the previous
token (sentencepiece's leading space) right. A delta is held back while the decoded window ends
with U+FFFD: that is a character whose UTF-8 bytes are split over tokens and not all here yet.

`StopStringMatcher` sits after it: it emits text up to (not including) the first stop string, and
holds back a tail that may still grow into one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

_REPLACEMENT = "\ufffd"
# NOTE: a stream of bytes that are never valid UTF-8 keeps the window ending in U+FFFD. Past this
# many pending ids we emit at a checked cut (see `_forced_delta`) so the work per id stays bounded.
_MAX_PENDING_IDS = 16
# An incomplete UTF-8 character is at most 3 bytes, and every token is at least one byte, so a cut
# 4 ids before the end is past any character still waiting for its bytes.
_CUT_BEFORE_END = 4


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (`kvwise.engine.tokenizer.Tokenizer` fits)."""

    @property
    def special_token_ids(self) -> frozenset[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turn generated ids into text deltas, one id at a time.

    Invariant: ``"".join(deltas) + flush() == tokenizer.decode(ids, skip_special_tokens)``, and
    no delta ends in a character that later ids could still change. Each `add` decodes only the
    window of pending ids plus one emitted id of context, so the cost per id does not grow with
    the output.

    Args:
        tokenizer: decodes ids; its `special_token_ids` are dropped when `skip_special_tokens`.
        skip_special_tokens: leave special tokens (e.g. ``<|im_end|>``) out of the text.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # ids[:prefix_offset] are no longer needed and get trimmed
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset]), cached
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (by `add` and `flush`)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Feed one id; return the new text it completes (maybe empty)."""
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) > len(self._prefix_text) and not window.endswith(_REPLACEMENT):
            return self._emit(window[len(self._prefix_text) :], len(self._ids))
        if len(self._ids) - self._read_offset > _MAX_PENDING_IDS:
            return self._forced_delta(window)
        return ""

    def flush(self) -> str:
        """Emit whatever is pending, U+FFFD included: call once the generation has ended."""
        window = self._decode(self._ids[self._prefix_offset :])
        return self._emit(window[len(self._prefix_text) :], len(self._ids))

    def _forced_delta(self, window: str) -> str:
        """Emit up to a cut `_CUT_BEFORE_END` ids back, if decoding is compositional there.

        If ``decode(head) + decode(tail) == decode(head + tail)`` and the tail has at least 4
        bytes, no character spans the cut that later bytes could change, so ``decode(head)``
        is final. At most 3 cuts in a row can fall inside one character, so this succeeds
        within a few ids and the window stays bounded.
        """
        cut = len(self._ids) - _CUT_BEFORE_END
        head = self._decode(self._ids[self._prefix_offset : cut])
        if head + self._decode(self._ids[cut:]) != window or len(head) < len(self._prefix_text):
            return ""
        return self._emit(head[len(self._prefix_text) :], cut)

    def _emit(self, delta: str, read_offset: int) -> str:
        # The last emitted id stays as context for the next window; older ids are dropped.
        self._prefix_offset = self._read_offset
        self._read_offset = read_offset
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopCheck(NamedTuple):
    """What `StopStringMatcher.feed` returns.

    text: text safe to emit now; when `stopped`, it ends just before the stop string.
    stopped: a stop string has matched; the generation should end.
    """

    text: str
    stopped: bool


class StopStringMatcher:
    """Find stop strings in streamed text, across delta boundaries.

    The match is the stop string that starts earliest in the text seen so far; the output ends
    just before it. Text that could still be the start of a stop string is held back (at most
    ``max(len(s) for s in stop) - 1`` characters) until it either completes a stop string or
    cannot. After a match every `feed` returns ``StopCheck("", True)``.

    Args:
        stop: the stop strings; each non-empty. An empty sequence never matches.

    Raises:
        ValueError: a stop string is empty or not a str.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise ValueError("stop: expected a list of strings, got a single str")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty str, got {s!r}")
        self._stop = tuple(dict.fromkeys(stop))
        self._max_held = max((len(s) for s in self._stop), default=1) - 1
        self._first_chars = frozenset(s[0] for s in self._stop)
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that matched (once stopped)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> StopCheck:
        """Take the next text delta; return what may be emitted and whether a stop matched."""
        if self._stopped:
            return StopCheck("", True)
        text = self._held + delta
        starts = [(i, s) for i, s in ((text.find(s), s) for s in self._stop) if i >= 0]
        if starts:
            start, self.matched = min(starts, key=lambda found: found[0])  # the first listed
            self._stopped, self._held = True, ""
            return StopCheck(text[:start], True)
        keep = self._partial_match_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopCheck(text[: len(text) - keep], False)

    def flush(self) -> str:
        """Release the held tail: call once the generation ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for start in range(max(0, len(text) - self._max_held), len(text)):
            if text[start] in self._first_chars:
                tail = text[start:]
                if any(s.startswith(tail) for s in self._stop):
                    return len(tail)
        return 0

"""The text ``kvwise eval`` reads and the sliding windows it reads it in (pure Python; the
window diagram is in ``bench/evaluate.py``)."""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path


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


def check_window_settings(ctx: int, stride: int, max_windows: int | None) -> None:
    """Raise ValueError unless ``ctx >= 2``, ``1 <= stride <= ctx`` and ``max_windows`` is None
    or positive."""
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

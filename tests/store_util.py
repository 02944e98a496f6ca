"""Helpers shared by the tier tests that need no model (tests/unit, tests/integration)."""

from __future__ import annotations

import hashlib


class FakeClock:
    """A clock the test moves by hand (``clock.t += 5``)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def key(i: int) -> bytes:
    """A 32-byte key, as a block hash would be."""
    return hashlib.sha256(str(i).encode()).digest()


def value(i: int, size: int = 100) -> bytes:
    """``size`` recognisable bytes for entry ``i``."""
    return (key(i) * (size // 32 + 1))[:size]

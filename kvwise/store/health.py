"""A tier's health: its errors by operation, the breaker they trip, and the log lines they
make. Pure Python.

Contract:
- An *error* is an exception (or a timeout) in one of a tier's operations: ``read`` (get,
  get_into, and opening what was read), ``write`` (put), ``lookup`` (contains), ``delete``.
  A miss is no error, and neither is a corrupt entry (the bytes were read; they fail their
  checks and are deleted: ``FaultLog.corrupt``).
- Each error is counted by operation (``TierStats.<op>_errors``: ``kvwise_tier_errors_total
  {tier, op}``). The first of each distinct error (operation, exception type, message) is
  logged with its traceback; the same one again is logged at most once a ``log_every_s``,
  with how many came since.
- The breaker: ``threshold`` consecutive errors of one operation open it (an operation's
  success resets its own run only: a tier whose reads all fail is broken however well it
  writes). While open, the store calls the tier for nothing (``base.guarded`` answers a miss
  at once). After ``cooldown_s`` it lets calls through again (half-open): the next success
  of the failing operation closes it, the next error opens it for another ``cooldown_s``.
- ``reason`` says why the tier is degraded ("" when it is not): its breaker is open, or its
  last error is under ``recent_s`` old. ``/health`` and the dashboard show it.

One ``TierHealth`` per tier, shared by every ``FaultLog`` that counts that tier's faults (the
tier's own and the store's): it is held by the tier's ``TierStats``. Thread safe.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("kvwise.store")

OPS = ("read", "write", "lookup", "delete")

# a tier operation's name (``base.guarded``'s ``op``, a tier's own fault kinds) -> its class
_OP_OF = {
    "get": "read",
    "get_into": "read",
    "open": "read",
    "read": "read",
    "put": "write",
    "write": "write",
    "extend": "write",
    "extend_keeps": "write",
    "contains": "lookup",
    "delete": "delete",
    "unlink": "delete",
}


def op_class(op: str) -> str:
    """The operation class (one of ``OPS``) of a tier operation's name."""
    try:
        return _OP_OF[op]
    except KeyError:
        raise ValueError(f"op: expected one of {sorted(_OP_OF)}, got {op!r}") from None


@dataclasses.dataclass
class _Seen:
    """One distinct error: when it was last logged and how many came since."""

    logged_at: float
    since: int = 0


class TierHealth:
    """One tier's error record and breaker (see the module docstring).

    Args:
        threshold: consecutive errors of one operation that open the breaker.
        cooldown_s: how long it stays open before letting calls through again.
        log_every_s: the least time between two log lines of the same error.
        recent_s: how long after its last error a tier is still reported degraded.
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(
        self,
        threshold: int = 5,
        cooldown_s: float = 30.0,
        log_every_s: float = 60.0,
        recent_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise ValueError(f"threshold: must be >= 1, got {threshold}")
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.log_every_s = log_every_s
        self.recent_s = recent_s
        self._clock = clock
        self._lock = threading.Lock()
        self._runs = dict.fromkeys(OPS, 0)  # consecutive errors by operation
        self._open_until = 0.0  # the breaker is open before this (0: never opened)
        self._last_error = ""  # "op: Type: message" of the newest error
        self._last_error_at = -float("inf")
        self._seen: dict[str, _Seen] = {}

    # ---- what the fault logs report ----------------------------------------------------------

    def error(
        self, tier: str, op: str, kind: str, detail: object = "", exc: BaseException | None = None
    ) -> None:
        """One error of operation ``op`` (a tier operation's name). ``kind`` says what failed
        and tells distinct errors apart (e.g. "ValueError: data and buf must not overlap",
        "read EIO"); ``detail`` is logged beside it (e.g. a path); ``exc`` carries the
        traceback."""
        op = op_class(op)
        now = self._clock()
        with self._lock:
            self._runs[op] += 1
            self._last_error, self._last_error_at = f"{op}: {kind}", now
            opened = self._runs[op] >= self.threshold and not self._is_open(now)
            if self._runs[op] >= self.threshold:
                self._open_until = now + self.cooldown_s
            line = self._log_line(f"{op}: {kind}", now)
        if line is not None:  # the traceback with the first of its kind only
            traceback = exc if not line else None
            where = f" ({detail})" if detail != "" else ""
            logger.error(
                "kv tier %s: %s error: %s%s%s", tier, op, kind, where, line, exc_info=traceback
            )
        if opened:
            logger.error(
                "kv tier %s: breaker open after %d consecutive %s errors: the tier is skipped "
                "for %g s (its loads are recomputed, its writes dropped)",
                tier,
                self.threshold,
                op,
                self.cooldown_s,
            )

    def success(self, tier: str, op: str) -> None:
        """Operation ``op`` worked: its run of errors ends (closing a half-open breaker when
        no other operation's run is at the threshold)."""
        op = op_class(op)
        with self._lock:
            if not self._runs[op]:
                return
            was_open = self._open_until > 0 and max(self._runs.values()) >= self.threshold
            self._runs[op] = 0
            closed = was_open and max(self._runs.values()) < self.threshold
            if closed:
                self._open_until = 0.0
        if closed:
            logger.warning("kv tier %s: %s works again: breaker closed", tier, op)

    # ---- what the store and the readers ask ---------------------------------------------------

    def allows(self) -> bool:
        """Whether the tier may be called now (breaker closed, or half-open)."""
        with self._lock:
            return not self._is_open(self._clock())

    def is_open(self) -> bool:
        with self._lock:
            return self._is_open(self._clock())

    def reason(self) -> str:
        """Why the tier is degraded; "" when it is not."""
        now = self._clock()
        with self._lock:
            if self._is_open(now):
                left = self._open_until - now
                return (
                    f"breaker open ({self.threshold} consecutive errors; retried in "
                    f"{left:.0f} s); last error: {self._last_error}"
                )
            if now - self._last_error_at < self.recent_s:
                return f"error {now - self._last_error_at:.0f} s ago: {self._last_error}"
            return ""

    def _is_open(self, now: float) -> bool:
        return now < self._open_until

    def _log_line(self, key: str, now: float) -> str | None:
        """The suffix of this error's log line, or None when it is not logged now."""
        seen = self._seen.get(key)
        if seen is None:
            if len(self._seen) >= 256:  # bounded: messages may carry paths, node names
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = _Seen(now)
            return ""
        if now - seen.logged_at < self.log_every_s:
            seen.since += 1
            return None
        line = f" (and {seen.since} more like it in the last {now - seen.logged_at:.0f} s)"
        seen.logged_at, seen.since = now, 0
        return line

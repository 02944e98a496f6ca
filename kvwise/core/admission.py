"""The order in which waiting requests are admitted: FIFO, without head-of-line blocking.

A waiting request that does not fit the pool now (whole-prompt admission: its prompt and a
block of its answer beside what the running ones still take) no longer stops the smaller ones
behind it: the scheduler looks on, up to ``ADMISSION_LOOKAHEAD`` entries into the queue, and
admits those that fit. Each request admitted past it is one *skip* of it
(``Request.num_admission_skips``); once a request has been skipped ``max_admission_skips``
times it is *aged*: nothing behind it is admitted before it, so it gets the blocks as the
running requests finish and is never starved. Its wait is thereby bounded by the decodes of
the requests running when it aged (what it waited for before this existed) plus at most
``max_admission_skips`` admissions ahead of it. ``max_admission_skips=0`` is strict FIFO.

::

    waiting:  [ big (blocked, 3 skips) | small (fits: admitted, big -> 4) | big2 (blocked) | ...
    aged big (skips == max):  [ big | ... ]   nothing behind it is admitted until it is

Pure Python; the scheduler owns the queue, this only walks it.
"""

from __future__ import annotations

from collections import deque

from kvwise.core.request import Request

ADMISSION_LOOKAHEAD = 32  # waiting requests one step considers (blocked ones included)


class WaitingScan:
    """One step's walk over the waiting queue, in order.

    ``next()`` is the next candidate (None: stop); the caller then either admits it (removing
    it from the queue, then ``admitted()``), finishes it (removing it), or leaves it waiting
    for blocks (``blocked()``, which moves past it unless it has aged).
    """

    def __init__(self, waiting: deque[Request], max_skips: int) -> None:
        self.waiting = waiting
        self.max_skips = max_skips
        self._index = 0  # of the next candidate: the blocked ones stay before it
        self._blocked: list[Request] = []
        self._stopped = False
        self.num_skips = 0  # admissions past a blocked request in this step
        self.num_aged = 0  # requests that reached max_skips in this step

    def next(self) -> Request | None:
        if self._stopped or self._index >= min(len(self.waiting), ADMISSION_LOOKAHEAD):
            return None
        return self.waiting[self._index]

    def blocked(self, request: Request) -> bool:
        """``request`` (the candidate) must wait for blocks. Returns whether to look past it:
        False once it has aged (or skipping is off), so nothing behind it goes first."""
        if request.num_admission_skips >= self.max_skips:
            return False
        self._blocked.append(request)
        self._index += 1
        return True

    def admitted(self) -> None:
        """The candidate was admitted (and left the queue): a skip of each blocked one before
        it. Stops the walk once one of them ages."""
        if not self._blocked:
            return
        self.num_skips += 1
        for request in self._blocked:
            request.num_admission_skips += 1
            if request.num_admission_skips == self.max_skips:
                self.num_aged += 1
                self._stopped = True  # nothing more goes ahead of it


def oldest_wait_s(waiting: deque[Request], now: float) -> float:
    """How long the longest-waiting request has waited (``now`` on its ``arrival_time``'s
    clock); 0.0 with none waiting."""
    return max((now - r.arrival_time for r in waiting), default=0.0)

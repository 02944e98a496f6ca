"""Progress of the long benchmarks, on stderr (stdout keeps their tables and JSON): a line when
a phase starts and one with its seconds when it ends (``phase``), and tqdm bars for the phases
that know their length: a count of turns (``bar``), or the seconds of a timed load
(``TimedBar``, with the load's counts beside it). Off a terminal a bar redraws every 10 s at
most, so a log gets a line now and then, not one per update."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tqdm import tqdm


def _tty() -> bool:
    return sys.stderr.isatty()


def note(text: str) -> None:
    """One progress line on stderr."""
    print(text, file=sys.stderr, flush=True)


@contextmanager
def phase(label: str) -> Iterator[None]:
    """``label ...`` on stderr now, ``label: done in N s`` (or ``failed after N s``) at the
    end of the block."""
    note(f"{label} ...")
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        note(f"{label}: failed after {time.perf_counter() - start:.1f} s")
        raise
    note(f"{label}: done in {time.perf_counter() - start:.1f} s")


def bar(total: int, desc: str, unit: str) -> tqdm:
    """A tqdm bar on stderr, counting ``unit``s up to ``total``."""
    return tqdm(
        total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=0.5 if _tty() else 10.0
    )


class TimedBar:
    """A bar over the ``duration_s`` seconds of a timed load, redrawn by ``run`` (an asyncio
    task) every half second with what ``counts()`` says (e.g. requests ok, 429s, tokens)."""

    def __init__(self, duration_s: float, desc: str, counts: Callable[[], dict]) -> None:
        self.duration_s = duration_s
        self.counts = counts
        self.bar = tqdm(
            total=round(duration_s, 1),
            desc=desc,
            file=sys.stderr,
            mininterval=0.5 if _tty() else 10.0,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}",
        )
        self._start = time.perf_counter()

    def _update(self) -> None:
        elapsed = min(time.perf_counter() - self._start, self.duration_s)
        self.bar.set_postfix(self.counts(), refresh=False)
        self.bar.update(round(elapsed, 1) - self.bar.n)

    async def run(self) -> None:
        """Redraw until cancelled."""
        while True:
            self._update()
            await asyncio.sleep(0.5)

    def close(self) -> None:
        self._update()
        self.bar.close()

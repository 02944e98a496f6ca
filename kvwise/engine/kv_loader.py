"""Streams a step's planned loads from the tiers into the device pool, layer group by layer
group, on a thread of its own while the model runs.

::

    loader thread:  read+check group 0 | copy | read+check group 1 | copy | ... | group G-1
    model (step):   wait(0) ... layers of group 0 | wait(1) ... layers of group 1 | ...

The model waits at the first layer of each group until that group is in place, so reading
the later layers overlaps computing the earlier ones. ``finish`` joins the thread and says,
per request, how many of its planned blocks were really loaded (checked, and matching the
prompt in every group); the scheduler rolls back any request that got fewer.

No wait is unbounded: each (``wait_layer``, and ``finish`` for the groups the model did not
wait for) gives up after ``wait_deadline_s``, derived from the deadlines of the tiers the
plan reads (``store.base.call_deadline``). A loader that misses it is *abandoned*: nothing
it read counts (every load of the step is short, so the scheduler rolls them back and
recomputes them: the output is unchanged), and it writes into the step's device blocks no
more.

NOTE: abandoning is safe because every write into the device blocks passes through a gate
(``_DeviceGate``): the loader's own copies, and the reader's (``store/reader.py``) decrypting
into ``payload_views`` and in-place reads, each hold it while they write. Abandoning shuts
the gate (later writers find it shut and write elsewhere or nowhere) and ``finish`` waits for
the writers inside to leave before the scheduler may reuse the blocks: copies at memory speed
and in-place reads from the local disk, which are joined rather than abandoned (a read cannot
be taken back once it writes into the blocks). A tier that blocks (a stuck Redis) blocks
outside the gate, reading into memory, and is left behind.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvwise.core.outputs import KVLoad
from kvwise.core.runner import ModelRunner
from kvwise.store.base import call_deadline
from kvwise.store.tiered import TieredStore

logger = logging.getLogger("kvwise")

_READ_AHEAD = 2  # layer groups being read at once
_WAIT_MARGIN_S = 1.0  # a group's checks and copies, on top of its reads' deadlines


@dataclass(frozen=True)
class LoadResult:
    num_loaded_blocks: int  # blocks loaded, over every request
    short: dict[str, int]  # requests that got fewer blocks than planned -> blocks they got
    # of ``num_loaded_blocks``, by the tier each chunk's first layer group came from
    blocks_by_tier: dict[str, int] = field(default_factory=dict)


class _DeviceGate:
    """Writes into one step's device blocks: held by each writer while it writes, until the
    step shuts it (see the module's NOTE)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._num_writers = 0

    @property
    def open(self) -> bool:
        return self._open

    @contextlib.contextmanager
    def writing(self) -> Iterator[bool]:
        """Held while writing into the blocks; says whether the gate was open (shut: write
        nothing there)."""
        with self._cond:
            entered = self._open
            self._num_writers += entered
        try:
            yield entered
        finally:
            if entered:
                with self._cond:
                    self._num_writers -= 1
                    self._cond.notify_all()

    def shut(self) -> None:
        """No writer enters from now on (those inside go on)."""
        with self._cond:
            self._open = False

    def wait_empty(self) -> None:
        """Wait until every writer that entered has left."""
        with self._cond:
            self._cond.wait_for(lambda: self._num_writers == 0)


class _Dest:
    """``reader.GatedDest`` for one layer group: where each chunk's payload lands, straight in its
    device blocks, while the gate is open."""

    def __init__(self, loader: KVLoader, group: int) -> None:
        self._loader = loader
        self._layers = loader.store.fmt.group_layers(group)
        self.writing = loader._gate.writing

    def __call__(self, i: int, entry_blocks: int) -> list | None:
        """Chunk ``i``'s payload views (the entry ends with the chunk; None: it is too short
        to hold it, or the loader was abandoned)."""
        loader = self._loader
        block_ids = loader.loads[i].block_ids
        skip = entry_blocks - len(block_ids)
        if skip < 0 or not loader._gate.open:
            return None
        return loader.runner.payload_views(block_ids, skip, entry_blocks, self._layers)


def wait_deadline(store: TieredStore, loads: list[KVLoad]) -> float:
    """How long the model waits for one layer group of ``loads`` at most: the group's reads
    from each tier the plan names, each within that tier's deadline (``_READ_AHEAD`` groups
    share the reader's threads, so a read may wait for another's), and its copies."""
    tiers = {t.name: t for t in store.tiers}
    names = {name for load in loads for name in load.chunk.tiers if name in tiers}
    return _READ_AHEAD * sum(call_deadline(tiers[n]) for n in names) + _WAIT_MARGIN_S


class KVLoader:
    """Loads one step's ``loads`` (see the module docstring): ``wait_layer`` for the model,
    ``finish`` after the step."""

    def __init__(self, store: TieredStore, runner: ModelRunner, loads: list[KVLoad]) -> None:
        self.store = store
        self.runner = runner
        self.loads = loads
        fmt = store.fmt
        self._layer_group = [fmt.group_of_layer(layer) for layer in range(fmt.num_layers)]
        self._ready = [threading.Event() for _ in range(fmt.layer_groups)]
        # blocks of each load that every group delivered so far
        self._loaded = [len(load.block_ids) for load in loads]
        self.waited = 0.0  # time the model spent waiting for layers (called from the step)
        self.wait_deadline_s = wait_deadline(store, loads)
        self.abandoned = False  # past a deadline: nothing it loaded counts
        self._gate = _DeviceGate()
        self._thread = threading.Thread(target=self._run, name="kvwise-kv-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fmt = self.store.fmt
        chunks = [load.chunk for load in self.loads]
        groups = range(fmt.layer_groups)
        # NOTE: reads run _READ_AHEAD groups ahead of the group being handed to the model:
        # enough to keep the disk busy, few enough that the bandwidth goes to the layers the
        # model needs first (with every group in flight at once, each finished late)
        pool = ThreadPoolExecutor(_READ_AHEAD, thread_name_prefix="kvwise-kv-load")

        in_place = self.runner.reads_in_place  # else host buffers, copied by write_kv

        def submit(g: int):
            dest = _Dest(self, g) if in_place else None
            return pool.submit(self.store.read_group, chunks, g, dest)

        try:
            pending = {g: submit(g) for g in groups[:_READ_AHEAD]}
            for group in groups:
                reads = pending.pop(group).result()
                if group + _READ_AHEAD < len(groups):
                    pending[group + _READ_AHEAD] = submit(group + _READ_AHEAD)
                t1, num_bytes = time.perf_counter(), 0
                with self._gate.writing() as still_wanted:
                    if not still_wanted:
                        return
                    for i, (load, read) in enumerate(zip(self.loads, reads)):
                        n = min(self._loaded[i], read.usable)
                        self._loaded[i] = n
                        if n and not read.in_place:
                            num_bytes += self.runner.write_kv(
                                load.block_ids[:n],
                                read.payload,
                                read.entry_blocks,
                                read.skip,
                                fmt.group_layers(group),
                            )
                if num_bytes:
                    self.store.observe_copy(num_bytes, time.perf_counter() - t1)
                self._ready[group].set()
        except Exception:  # a bug here must not hang the step: load nothing instead
            logger.exception("loading KV from the tiers failed")
            self._abandon()
        finally:
            for event in self._ready:
                event.set()
            # NOTE: never waits: reads still in flight (only after an abandon) end on their
            # own, behind the shut gate
            pool.shutdown(wait=False, cancel_futures=True)

    def _abandon(self, why: str = "") -> None:
        """Give up on this step's loads: none counts, no more writes into the blocks."""
        self._gate.shut()
        if not self.abandoned and why:
            logger.warning("KV load abandoned: %s; its prompts are recomputed", why)
        self.abandoned = True
        for event in self._ready:
            event.set()

    def _wait(self, group: int) -> None:
        """Wait for ``group`` within the deadline; past it, abandon the loader."""
        if not self._ready[group].wait(self.wait_deadline_s):
            self._abandon(f"layer group {group} not read within {self.wait_deadline_s:.2f} s")

    def wait_layer(self, layer: int) -> None:
        group = self._layer_group[layer]
        if not self._ready[group].is_set():
            t0 = time.perf_counter()
            self._wait(group)
            self.waited += time.perf_counter() - t0

    def finish(self) -> LoadResult:
        """Join the loader (the groups the model did not wait for within the deadline too)
        and say what arrived: a request that got fewer blocks than planned is short by
        everything from its first short chunk on (an abandoned loader: every request, by
        everything)."""
        for group in range(len(self._ready)):
            self._wait(group)
        if self.abandoned:
            self._gate.shut()
            self._gate.wait_empty()  # the blocks are the scheduler's again after this
            loaded_per_load = [0] * len(self.loads)
        else:
            self._thread.join()
            loaded_per_load = self._loaded
        loaded: dict[str, int] = {}
        short: dict[str, int] = {}
        by_tier: dict[str, int] = {}
        for load, n in zip(self.loads, loaded_per_load):
            rid = load.request_id
            if rid in short:
                continue
            loaded[rid] = loaded.get(rid, 0) + n
            if n:
                tier = load.chunk.tiers[0]
                by_tier[tier] = by_tier.get(tier, 0) + n
            if n < len(load.block_ids):
                short[rid] = loaded[rid]
        return LoadResult(sum(loaded.values()), short, by_tier)

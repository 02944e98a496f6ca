"""Streams a step's planned loads from the tiers into the device pool, layer group by layer
group, on a thread of its own while the model runs.

::

    loader thread:  read+check group 0 | copy | read+check group 1 | copy | ... | group G-1
    model (step):   wait(0) ... layers of group 0 | wait(1) ... layers of group 1 | ...

The model waits at the first layer of each group until that group is in place, so reading
the later layers overlaps computing the earlier ones. ``finish`` joins the thread and says,
per request, how many of its planned blocks were really loaded (checked, and matching the
prompt in every group); the scheduler rolls back any request that got fewer.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvwise.core.outputs import KVLoad

logger = logging.getLogger("kvwise")

_READ_AHEAD = 2  # layer groups being read at once


@dataclass(frozen=True)
class LoadResult:
    num_loaded_blocks: int  # blocks loaded, over every request
    short: dict[str, int]  # requests that got fewer blocks than planned -> blocks they got
    # of ``num_loaded_blocks``, by the tier each chunk's first layer group came from
    blocks_by_tier: dict[str, int] = field(default_factory=dict)


class KVLoader:
    def __init__(self, store, runner, loads: list[KVLoad]) -> None:
        self.store = store
        self.runner = runner
        self.loads = loads
        fmt = store.fmt
        self._layer_group = [fmt.group_of_layer(layer) for layer in range(fmt.num_layers)]
        self._ready = [threading.Event() for _ in range(fmt.layer_groups)]
        # blocks of each load that every group delivered so far
        self._loaded = [len(load.block_ids) for load in loads]
        self.waited = 0.0  # time the model spent waiting for layers (called from the step)
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

        def submit(g: int):
            return pool.submit(self.store.read_group, chunks, g, self._dest(g))

        try:
            pending = {g: submit(g) for g in groups[:_READ_AHEAD]}
            for group in groups:
                reads = pending.pop(group).result()
                if group + _READ_AHEAD < len(groups):
                    pending[group + _READ_AHEAD] = submit(group + _READ_AHEAD)
                t1, num_bytes = time.perf_counter(), 0
                for i, (load, read) in enumerate(zip(self.loads, reads)):
                    n = min(self._loaded[i], read.usable)
                    self._loaded[i] = n
                    if n and not read.in_place:
                        num_bytes += self.runner.write_kv(
                            load.block_ids[:n], read.payload, read.entry_blocks, read.skip,
                            fmt.group_layers(group),
                        )  # fmt: skip
                if num_bytes:
                    self.store.observe_copy(num_bytes, time.perf_counter() - t1)
                self._ready[group].set()
        except Exception:  # a bug here must not hang the step: load nothing instead
            logger.exception("loading KV from the tiers failed")
            self._loaded = [0] * len(self.loads)
        finally:
            for event in self._ready:
                event.set()
            pool.shutdown(wait=True)

    def _dest(self, group: int):
        layers = self.store.fmt.group_layers(group)

        def dest(i: int, entry_blocks: int) -> list | None:
            """Where chunk ``i``'s payload lands: straight in its device blocks (the entry
            ends with the chunk; None: it is too short to hold it)."""
            block_ids = self.loads[i].block_ids
            skip = entry_blocks - len(block_ids)
            if skip < 0:
                return None
            return self.runner.payload_views(block_ids, skip, entry_blocks, layers)

        return dest

    def wait_layer(self, layer: int) -> None:
        event = self._ready[self._layer_group[layer]]
        if not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            self.waited += time.perf_counter() - t0

    def finish(self) -> LoadResult:
        """Join the loader and say what arrived: a request that got fewer blocks than planned
        is short by everything from its first short chunk on."""
        self._thread.join()
        loaded: dict[str, int] = {}
        short: dict[str, int] = {}
        by_tier: dict[str, int] = {}
        for load, n in zip(self.loads, self._loaded):
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

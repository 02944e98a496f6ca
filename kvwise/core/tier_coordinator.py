"""The tiers below the pool, as the scheduler uses them: ``TierCoordinator`` plans loads at
admission (kept while a request waits for blocks), hands them to the worker boundary as
``KVLoad`` items, rolls a short load back, and queues the saves of a request leaving the pool
(``KVSave``, ``save_plans``). Pure Python: the I/O is the ``KVTierPlanner``'s (``store``).

The scheduler schedules and the ``KVCacheManager`` keeps blocks; this owns the load plans: one
per waiting request (``_waiting``: so the tiers are not asked again at every step while it
waits) and one per request admitted with a load in the current step (``_step``: what a short
load is rolled back against). Without tiers (or with caching off) every method is a no-op and
``plan_load`` plans nothing.
"""

from __future__ import annotations

from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.kv_tiers import KVTierPlanner
from kvwise.core.load_plans import GroupLoad, plan_group_loads
from kvwise.core.outputs import KVLoad, KVSave, ScheduledRequest, SchedulerOutput
from kvwise.core.request import Request
from kvwise.core.save_plans import plan_saves


class TierCoordinator:
    """See the module docstring. ``tiers``: None when there are none (or caching is off)."""

    def __init__(self, tiers: KVTierPlanner | None, kv: KVCacheManager) -> None:
        self.tiers = tiers
        self.kv = kv
        self.num_load_rollbacks = 0
        self._saves: list[KVSave] = []
        # request id -> (device blocks it was planned for, loads): kept while it waits
        self._waiting: dict[str, tuple[int, list[GroupLoad]]] = {}
        # admitted with a load in this step: (device blocks, loads)
        self._step: dict[str, tuple[int, list[GroupLoad]]] = {}

    def begin_step(self) -> None:
        """A new step: the previous step's loads are settled."""
        self._step = {}

    # ---- loads --------------------------------------------------------------------------

    def plan_load(self, request: Request, num_device_blocks: int) -> list[GroupLoad]:
        """The stored continuation of a device prefix hit that is worth loading, if any: a
        ``(group, plan, first block)`` per KV group, group 0's first (its plan chose how far
        to load; ``first``: where group 0's starts, past the device hit, for a windowed
        group 0 whose load starts at its window). Empty: nothing to load. A request that
        waits for blocks keeps its plan."""
        if self.tiers is None or request.sampling_params.prompt_logprobs is not None:
            return []  # (prompt logprobs: every prompt row is computed)
        kept = self._waiting.get(request.request_id)
        if kept is not None and kept[0] == num_device_blocks:
            return kept[1]
        loads = plan_group_loads(self.tiers, self.kv, request, num_device_blocks)
        self._waiting[request.request_id] = (num_device_blocks, loads)
        return loads

    def admitted(
        self,
        request: Request,
        num_device_blocks: int,
        loads: list[GroupLoad],
        tables: list[list[int]],
        out: SchedulerOutput,
    ) -> None:
        """``request`` was admitted with ``loads`` into ``tables``: its loads go into
        ``out.kv_loads`` (each chunk into the fresh blocks after its device hit)."""
        self._waiting.pop(request.request_id, None)
        if not loads:
            return
        self._step[request.request_id] = (num_device_blocks, loads)
        for group, plan, first in loads:
            ids = tables[group]
            for chunk in plan.chunks:
                out.kv_loads.append(
                    KVLoad(request.request_id, ids[first : first + chunk.num_blocks], chunk)
                )
                first += chunk.num_blocks

    def forget(self, request_id: str) -> None:
        """``request_id`` finished: its kept plan goes."""
        self._waiting.pop(request_id, None)

    def roll_back(self, request: Request, item: ScheduledRequest, num_loaded: int) -> None:
        """A planned load delivered fewer blocks than planned (a miss, a fault or an entry
        that stopped matching): what this step computed for the request rests on KV that is
        not there, so keep only what was verified and recompute the rest from there (a
        hybrid or windowed model: from the device hit, since a group's verified blocks need
        the others' and their window's).

        ::

            | device hit | loaded ok | missing ... | this step's tokens |   (before)
            | device hit | loaded ok |<- recomputed from here, next steps ->|
        """
        num_device, loads = self._step.pop(request.request_id)
        _, plan, first = loads[0]
        if len(loads) > 1 or first != num_device:
            num_loaded = 0
        planned = first + plan.num_blocks - num_device
        missing_tokens = (planned - num_loaded) * self.kv.block_size
        request.num_computed_tokens = item.start_pos - missing_tokens
        # NOTE: clamped: after a preemption these counts may predate this admission
        request.num_loaded_tokens = max(0, request.num_loaded_tokens - missing_tokens)
        request.num_cached_tokens = max(0, request.num_cached_tokens - missing_tokens)
        self.kv.cache_full_blocks(request)
        self.num_load_rollbacks += 1
        if self.tiers is not None:
            for _, group_plan, _ in loads:
                self.tiers.roll_back(group_plan, num_loaded)

    # ---- saves --------------------------------------------------------------------------

    def plan_saves(self, request: Request, windowed_only: bool = False, soon: bool = False):
        """Queue the blocks of a request leaving the pool for the tiers (``save_plans``);
        ``windowed_only``: its windowed groups' now, as its prompt is done; ``soon``: it was
        preempted and will load them back."""
        if self.tiers is not None:
            self._saves.extend(plan_saves(self.tiers, self.kv, request, windowed_only, soon))

    def take_saves(self) -> list[KVSave]:
        """Blocks to copy out for the tiers; copy them before the next step runs."""
        saves, self._saves = self._saves, []
        return saves

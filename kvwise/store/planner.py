"""Plans for the tiers, no data moved: which stored entries continue a prompt and how many of
them to load, which entries of a leaving sequence to write. Pure Python.

An *entry* is a run of consecutive blocks of a sequence, stored as ``layer_groups`` entries
(one per run of layers), each keyed by ``fmt.entry_key(chain hash of its LAST block,
group)``: the key names the whole prefix the entry ends, so sequences that share only its
first blocks never overwrite it. A sequence is cut into entries at every multiple of
``chunk_blocks`` and at the ``cuts`` its writer names (where its device prefix hit ended,
where its prompt ended: where another request is likely to stop sharing it)::

    blocks of a prompt:   | 0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 |   (chunk_blocks = 4)
    one writer's entries: |  e3     |e5 | e7  |  e11      | e13   |   (a cut after block 5)
    device prefix hit:    |<- 0..2 ->|
    load from the tiers:   e3 (skip 0..2), e5, e7, e11, e13: every present end in order

A load cannot know where a stored entry starts (another writer may have cut the sequence
elsewhere), so it asks for an entry ending at *every* block after the device hit (one batched
``contains`` per tier, layer group 0 first) and takes the present ends in order, each to cover
the blocks from the one after the previous end: in a store written as above, the entry that
ends first after a block also covers it. The reader checks that from the entry's header; an
entry that starts too late is a miss, never wrong KV.

Contract:
- ``plan_load`` asks each tier at most twice (layer group 0 for every end, then the other
  groups of the ends found) and reads nothing. Policy "never": no plan; "always": all of the
  run; "auto": as much as ``CostModel.choose`` says beats recomputing. Each call that finds
  a run records a ``LoadDecision`` (``decisions``, the last 1000) and counts it in
  ``load_decisions`` or ``recompute_decisions`` (the stored tokens it leaves to be recomputed
  in ``recomputed_tokens``); a call that finds nothing counts in
  ``lookup_misses`` (another model's or KV format's entries are found never: their keys
  have another root).
- ``KnownChunks`` remembers which entries the tiers hold (a hint, bounded; a wrong hint costs
  a rewrite or an entry left unwritten, never wrong KV). ``plan_writes`` returns only entries
  it does not know as stored in every tier, and remembers them as stored; the writer forgets
  the ones a tier failed to store. Hits read by the reader are remembered, corrupt entries it
  deletes forgotten; ``roll_back`` forgets the entries a load failed to deliver, so that their
  recomputed blocks are written again.
- A tier that raises in ``contains`` has faulted: its answer is "none of them"
  (``base.guarded``), never an error of the engine thread that plans. A tier that can block
  bounds its ``contains`` by its ``deadline_s`` (the engine thread waits at most that).
- Calls come from the engine thread; the known map is also updated from the loader thread
  and is locked.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvwise.config import LOAD_POLICIES
from kvwise.core.kv_spec import first_window_block
from kvwise.core.kv_tiers import ChunkWrite, LoadPlan, PlannedChunk
from kvwise.store import serde
from kvwise.store.base import FaultLog, KVStore, guarded
from kvwise.store.costmodel import CostModel, LoadDecision

logger = logging.getLogger("kvwise.store")

_MAX_KNOWN = 200_000  # entries remembered as stored (to skip rewriting them)


class KnownChunks:
    """Entry (its last block's chain hash) -> how many of the top tiers lack it (0: none):
    the entries the tiers are believed to hold. Least recently remembered forgotten first."""

    def __init__(self, max_chunks: int = _MAX_KNOWN) -> None:
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> int | None:
        """How many of the top tiers lack the entry (None: not known as stored)."""
        with self._lock:
            return self._chunks.get(key)

    def remember(self, key: bytes, missing_above: int = 0) -> None:
        with self._lock:
            self._chunks[key] = missing_above
            self._chunks.move_to_end(key)
            if len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._chunks.pop(key, None)

    def __len__(self) -> int:
        return len(self._chunks)


@dataclass(frozen=True)
class _Stored:
    """A stored entry, as far as one prompt would use it: blocks ``first_block`` to
    ``end_block`` (exclusive; the entry ends there and may start earlier)."""

    first_block: int
    end_block: int
    tiers: tuple[str, ...]  # the tier each layer group would be read from
    num_bytes: int  # bytes a read takes at least (every group; entries may hold more blocks)


def other_groups_cost(fmt: serde.EntryFormat, start: int, chunk_blocks: int):
    """A hybrid model's other KV groups' share of a load of blocks ``start .. end - 1``
    (group 0's share is the plan's): ``extra(end) -> (entries, bytes)``, each full group
    the same blocks again, each windowed group the blocks of its window at ``end`` past
    ``start``; None without other groups."""
    groups = fmt.spec.groups
    if len(groups) < 2:
        return None
    bs, layer_groups = fmt.block_size, fmt.layer_groups

    def extra(end: int) -> tuple[int, int]:
        entries = num_bytes = 0
        for group in groups[1:]:
            n = end - max(start, first_window_block(group.window, bs, end * bs))
            if n > 0:
                entries += -(-n // chunk_blocks) * layer_groups
                num_bytes += sum(fmt.entry_bytes(g, n) for g in range(layer_groups))
        return entries, num_bytes

    return extra


class ChunkPlanner:
    """Load and write plans over ``tiers`` (top first): ``core.kv_tiers.KVTierPlanner``, see
    the module docstring.

    Args:
        chunk_blocks: blocks per stored chunk.
        min_tokens: sequences shorter than this are not written.
        policy: "auto" (the cost model decides), "always" or "never" (benchmarks).
    """

    def __init__(
        self,
        tiers: Sequence[KVStore],
        fmt: serde.EntryFormat,
        cost: CostModel,
        chunk_blocks: int = 8,
        min_tokens: int = 64,
        policy: str = "auto",
    ) -> None:
        self.tiers = list(tiers)
        self.fmt = fmt
        self.cost = cost
        self.chunk_blocks = chunk_blocks
        self.min_tokens = min_tokens
        self.policy = policy
        self.known = KnownChunks()
        self._faults = [FaultLog(t.name, t.stats) for t in self.tiers]  # by tier index
        self.decisions: deque[LoadDecision] = deque(maxlen=1000)
        self.load_decisions = 0
        self.recompute_decisions = 0
        self.lookup_misses = 0  # prompts past their device hit that no tier continued
        self.recomputed_tokens = 0  # stored prefix tokens the cost model chose not to load

    @property
    def policy(self) -> str:
        return self._policy

    @policy.setter
    def policy(self, policy: str) -> None:
        if policy not in LOAD_POLICIES:
            raise ValueError(f"policy: expected one of {LOAD_POLICIES}, got {policy!r}")
        self._policy = policy

    # ---- loads --------------------------------------------------------------------------

    def plan_load(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_device_blocks: int,
        max_blocks: int,
        num_prompt_tokens: int,
    ) -> LoadPlan | None:
        """``KVTierPlanner.plan_load``."""
        start = num_device_blocks
        if start >= max_blocks or not self.tiers or self.policy == "never":
            return None
        stored = self._find(block_hashes, start, max_blocks)
        if not stored:
            self.lookup_misses += 1
            return None
        num_chunks = self._decide(request_id, start, stored, num_prompt_tokens)
        if num_chunks == 0:
            return None
        chunks = [
            PlannedChunk(
                s.first_block,
                s.end_block - s.first_block,
                tuple(block_hashes[s.first_block : s.end_block]),
                s.tiers,
            )
            for s in stored[:num_chunks]
        ]
        return LoadPlan(stored[num_chunks - 1].end_block - start, chunks)

    def plan_span(self, block_hashes: Sequence[bytes], start: int, end: int) -> LoadPlan | None:
        """``KVTierPlanner.plan_span``: the entries that hold blocks ``start .. end - 1``
        exactly, or None (no decision: a hybrid model's other groups follow group 0's)."""
        if start >= end:
            return LoadPlan(0, [])
        if not self.tiers:
            return None
        stored = self._find(block_hashes, start, end)
        if not stored or stored[-1].end_block != end:
            return None
        chunks = [
            PlannedChunk(
                s.first_block,
                s.end_block - s.first_block,
                tuple(block_hashes[s.first_block : s.end_block]),
                s.tiers,
            )
            for s in stored
        ]
        return LoadPlan(end - start, chunks)

    def _find(self, block_hashes: Sequence[bytes], start: int, max_blocks: int) -> list[_Stored]:
        """The stored entries that continue block ``start``, in order: every block up to
        ``max_blocks`` that an entry ends with (layer group 0 asked first, for all of them),
        as long as every layer group of it is in some tier."""
        fmt, groups = self.fmt, self.fmt.layer_groups
        ends = range(start, max_blocks)
        located = self._locate([fmt.entry_key(block_hashes[e], 0) for e in ends])
        present = [(e, tier) for e, tier in zip(ends, located) if tier is not None]
        rest: list[KVStore | None] = []
        if groups > 1 and present:
            rest = self._locate(
                [fmt.entry_key(block_hashes[e], g) for e, _ in present for g in range(1, groups)]
            )
        stored, first = [], start
        for i, (end, tier) in enumerate(present):
            tiers = [tier, *rest[i * (groups - 1) : (i + 1) * (groups - 1)]]
            if any(t is None for t in tiers):
                break
            # an entry holds at least the blocks this prompt would use from it
            num_bytes = sum(fmt.entry_bytes(g, end + 1 - first) for g in range(groups))
            stored.append(_Stored(first, end + 1, tuple(t.name for t in tiers), num_bytes))
            first = end + 1
        return stored

    def _decide(
        self, request_id: str, start: int, stored: list[_Stored], num_prompt_tokens: int
    ) -> int:
        """How many of the ``stored`` chunks to load; records the decision."""
        bs = self.fmt.block_size
        start_tokens, ends = start * bs, [s.end_block * bs for s in stored]
        per_tier = [s.tiers[0] for s in stored]  # the cost model sees the first group's tier
        if self.policy == "always":
            m, t_load, t_rec = len(ends), 0.0, self.cost.t_recompute(start_tokens, ends[-1])
        else:
            extra = other_groups_cost(self.fmt, start, self.chunk_blocks)
            m, t_load, t_rec = self.cost.choose(
                start_tokens,
                ends,
                per_tier,
                [s.num_bytes for s in stored],
                self.fmt.block_bytes / bs,
                num_prompt_tokens,
                self.fmt.layer_groups,
                extra=None if extra is None else (lambda end: extra(end // bs)),
            )
        chosen_tokens = ends[m - 1] - start_tokens if m else 0
        decision = LoadDecision(
            request_id,
            start_tokens,
            ends[-1] - start_tokens,
            chosen_tokens,
            tuple(per_tier),
            t_load,
            t_rec,
        )
        self.decisions.append(decision)
        logger.debug("load decision: %s", decision)
        if decision.recomputed_instead:
            self.recompute_decisions += 1
            self.recomputed_tokens += decision.available_tokens - decision.chosen_tokens
        else:
            self.load_decisions += 1
        return m

    def roll_back(self, plan: LoadPlan, num_loaded_blocks: int) -> None:
        """``KVTierPlanner.roll_back``: every entry of ``plan`` not delivered whole is
        forgotten."""
        num_blocks = 0
        for chunk in plan.chunks:
            num_blocks += chunk.num_blocks
            if num_blocks > num_loaded_blocks:
                self.known.forget(chunk.key)

    # ---- writes and sessions ------------------------------------------------------------

    def plan_writes(
        self,
        block_hashes: Sequence[bytes],
        num_full_blocks: int,
        cuts: Sequence[int] = (),
        first_block: int = 0,
    ) -> list[ChunkWrite]:
        """``KVTierPlanner.plan_writes``; what it returns is remembered as stored."""
        writes = []
        for first, hashes in self._entries(block_hashes, num_full_blocks, cuts, first_block):
            missing_above = self.known.get(hashes[-1])
            if missing_above != 0:  # unknown (None: every tier) or lacking in the top tiers
                self.known.remember(hashes[-1])
                writes.append(ChunkWrite(first, hashes, missing_above))
        return writes

    def plan_keeps(
        self,
        block_hashes: Sequence[bytes],
        num_full_blocks: int,
        cuts: Sequence[int] = (),
        first_block: int = 0,
    ) -> list[ChunkWrite]:
        """``KVTierPlanner.plan_keeps``: the entries ``plan_writes`` would cut that are known
        as stored (in some tier)."""
        return [
            ChunkWrite(first, hashes)
            for first, hashes in self._entries(block_hashes, num_full_blocks, cuts, first_block)
            if self.known.get(hashes[-1]) is not None
        ]

    def _entries(
        self, block_hashes: Sequence[bytes], n: int, cuts: Sequence[int], first: int
    ) -> list[tuple[int, tuple[bytes, ...]]]:
        """``(first block, block hashes)`` of each entry a sequence of ``n`` full blocks is
        cut into (see the module docstring), from block ``first`` on; none when it is not
        stored at all (too short, no tiers)."""
        if not self.tiers or n * self.fmt.block_size < self.min_tokens or first >= n:
            return []
        ends = sorted(
            {*range(self.chunk_blocks, n, self.chunk_blocks), n}
            | {x for x in cuts if first < x < n}
        )
        entries = []
        for end in (e for e in ends if e > first):
            entries.append((first, tuple(block_hashes[first:end])))
            first = end
        return entries

    def num_stored_blocks(self, block_hashes: Sequence[bytes], num_full_blocks: int) -> int:
        """Leading blocks of a sequence that the tiers hold, every layer group."""
        stored = self._find(block_hashes, 0, num_full_blocks)
        return stored[-1].end_block if stored else 0

    def _locate(self, keys: list[bytes]) -> list[KVStore | None]:
        """The first tier holding each key (None: in no tier)."""
        located: list[KVStore | None] = [None] * len(keys)
        for tier, faults in zip(self.tiers, self._faults):
            todo = [i for i, t in enumerate(located) if t is None]
            if not todo:
                break
            found = guarded(
                faults, "contains", tier.contains, [keys[i] for i in todo], miss=[False] * len(todo)
            )
            for i, present in zip(todo, found):
                if present:
                    located[i] = tier
        return located

"""Plans for the tiers, no data moved: which stored chunks continue a prompt and how many of
them to load, which chunks of a leaving sequence to write. Pure Python.

A *chunk* is ``chunk_blocks`` consecutive blocks of a sequence, aligned at multiples of
``chunk_blocks``; it is stored as ``layer_groups`` entries, one per run of layers, keyed by
``serde.entry_key(chain hash of its first block, group)``::

    blocks of a prompt:  | 0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 |   (chunk_blocks = 4)
    chunks:              |  h0     |  h4     |  h8       | h12 (partial: the tail) |
    device prefix hit:   |<- 0..5 ->|
    load from tiers:          skip 4,5 of h4; then h8; then h12 ... while they match

Contract:
- ``plan_load`` asks each tier at most once (one batched ``contains``, for the keys no tier
  above holds) which chunks continue the device hit: the run of chunks whose every layer
  group some tier holds. It reads nothing. Policy "never": no plan; "always": all of the
  run; "auto": as much as ``CostModel.choose`` says beats recomputing. Each call that finds
  a run records a ``LoadDecision`` (``decisions``, the last 1000) and counts it in
  ``load_decisions`` or ``recompute_decisions``.
- ``KnownChunks`` remembers which chunks the tiers hold (a hint, bounded; a wrong hint costs
  a rewrite or a chunk left unwritten, never wrong KV). ``plan_writes`` returns only chunks
  it does not know as stored whole, and remembers them as stored. Hits read by the reader
  are remembered, corrupt entries it deletes forgotten; ``roll_back`` forgets the chunks a
  load failed to deliver, so that their recomputed blocks are written again.
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
from kvwise.core.kv_tiers import ChunkWrite, LoadPlan, PlannedChunk
from kvwise.store import serde
from kvwise.store.base import KVStore
from kvwise.store.costmodel import CostModel, LoadDecision

logger = logging.getLogger("kvwise.store")

_MAX_KNOWN = 200_000  # chunk keys remembered as stored (to skip rewriting them)


class KnownChunks:
    """Chunk key (its first block's hash) -> ``(last block hash, tiers lacking it)``: the
    chunk the tiers are believed to hold ends with that block, and the first ``tiers lacking
    it`` tiers (0: none) do not hold it yet. Least recently remembered forgotten first."""

    def __init__(self, max_chunks: int = _MAX_KNOWN) -> None:
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> tuple[bytes | None, int]:
        with self._lock:
            return self._chunks.get(key, (None, 0))

    def remember(self, key: bytes, last_hash: bytes, missing_above: int = 0) -> None:
        with self._lock:
            self._chunks[key] = (last_hash, missing_above)
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
    """A chunk the tiers hold, as far as one prompt would use it."""

    first_block: int
    end_block: int  # exclusive: the chunk's end or the prompt's ``max_blocks``
    tiers: tuple[str, ...]  # the tier each layer group would be read from
    num_bytes: int  # bytes a read takes at least (every group; entries may hold more blocks)


class ChunkPlanner:
    """Load and write plans over ``tiers`` (top first); see the module docstring.

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
        self.decisions: deque[LoadDecision] = deque(maxlen=1000)
        self.load_decisions = 0
        self.recompute_decisions = 0

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
        """``KVTierPlanner.plan_load``: the stored continuation of a device hit worth loading."""
        start = num_device_blocks
        if start >= max_blocks or not self.tiers or self.policy == "never":
            return None
        stored = self._find(block_hashes, start, max_blocks)
        if not stored:
            return None
        num_chunks = self._decide(request_id, start, stored, num_prompt_tokens)
        if num_chunks == 0:
            return None
        chunks = []
        for s in stored[:num_chunks]:
            skip = max(start - s.first_block, 0)
            hashes = tuple(block_hashes[s.first_block : s.end_block])
            num_blocks = s.end_block - s.first_block - skip
            chunks.append(PlannedChunk(s.first_block, skip, num_blocks, hashes, s.tiers))
        return LoadPlan(stored[num_chunks - 1].end_block - start, chunks)

    def _find(self, block_hashes: Sequence[bytes], start: int, max_blocks: int) -> list[_Stored]:
        """The run of chunks, from the one holding block ``start``, that every layer group
        of is in some tier."""
        c, groups = self.chunk_blocks, self.fmt.layer_groups
        firsts = range(start // c * c, max_blocks, c)
        located = self._locate([k for f in firsts for k in self._keys(block_hashes[f])])
        stored = []
        for i, first in enumerate(firsts):
            tiers = located[i * groups : (i + 1) * groups]
            if any(t is None for t in tiers):
                break
            end = min(first + c, max_blocks)
            # an entry holds at least the blocks this prompt would use from it
            num_bytes = sum(self.fmt.entry_bytes(g, end - first) for g in range(groups))
            stored.append(_Stored(first, end, tuple(t.name for t in tiers), num_bytes))
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
            m, t_load, t_rec = self.cost.choose(
                start_tokens, ends, per_tier, [s.num_bytes for s in stored],
                self.fmt.block_bytes / bs, num_prompt_tokens, self.fmt.layer_groups,
            )  # fmt: skip
        chosen_tokens = ends[m - 1] - start_tokens if m else 0
        decision = LoadDecision(request_id, start_tokens, ends[-1] - start_tokens, chosen_tokens,
                                tuple(per_tier), t_load, t_rec)  # fmt: skip
        self.decisions.append(decision)
        logger.debug("load decision: %s", decision)
        if decision.recomputed_instead:
            self.recompute_decisions += 1
        else:
            self.load_decisions += 1
        return m

    def roll_back(self, plan: LoadPlan, num_loaded_blocks: int) -> None:
        """``KVTierPlanner.roll_back``: forget every chunk of ``plan`` not delivered whole
        (the first ``num_loaded_blocks`` blocks of the plan were)."""
        num_blocks = 0
        for chunk in plan.chunks:
            num_blocks += chunk.num_blocks
            if num_blocks > num_loaded_blocks:
                self.known.forget(chunk.block_hashes[0])

    # ---- writes and sessions ------------------------------------------------------------

    def plan_writes(self, block_hashes: Sequence[bytes], num_full_blocks: int) -> list[ChunkWrite]:
        """Chunks of a finished (or preempted) sequence that the tiers do not hold yet."""
        if not self.tiers or num_full_blocks * self.fmt.block_size < self.min_tokens:
            return []
        c, writes = self.chunk_blocks, []
        for first in range(0, num_full_blocks, c):
            hashes = tuple(block_hashes[first : min(first + c, num_full_blocks)])
            last, missing_above = self.known.get(hashes[0])
            if last == hashes[-1] and not missing_above:
                continue
            self.known.remember(hashes[0], hashes[-1])
            writes.append(ChunkWrite(first, hashes, missing_above if last == hashes[-1] else None))
        return writes

    def num_stored_blocks(self, block_hashes: Sequence[bytes], num_full_blocks: int) -> int:
        """Leading blocks of a sequence that the tiers hold, every layer group."""
        stored = self._find(block_hashes, 0, num_full_blocks)
        return stored[-1].end_block if stored else 0

    def _keys(self, first_block_hash: bytes) -> list[bytes]:
        return [self.fmt.entry_key(first_block_hash, g) for g in range(self.fmt.layer_groups)]

    def _locate(self, keys: list[bytes]) -> list[KVStore | None]:
        """The first tier holding each key (None: in no tier)."""
        located: list[KVStore | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, t in enumerate(located) if t is None]
            if not todo:
                break
            for i, present in zip(todo, tier.contains([keys[i] for i in todo])):
                if present:
                    located[i] = tier
        return located

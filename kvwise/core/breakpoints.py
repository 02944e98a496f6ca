"""Cache breakpoints (Anthropic's ``cache_control``) as keeps on a prompt's leading blocks.
Pure Python.

A request's ``RequestOptions.cache_breakpoints`` say "keep my first ``num_tokens`` prompt
tokens for ``ttl_s``". Here they become *keep runs* over whole blocks (only full blocks are
cached), each block under the longest TTL of the breakpoints covering it::

    prompt:  | b0 | b1 | b2 | b3 | b4 | b5 | b6 |..
    1h bp:   |<------- 1h ------>|                     (num_tokens: 3.5 blocks -> 3)
    5m bp:   |<-------------- 5m ------------->|       (6 blocks)
    runs:    | 1h: [0, 3)        | 5m: [3, 6)  |  b6..: plain LRU

Contract:
- A breakpoint covering fewer than ``min_tokens`` tokens keeps nothing (Anthropic's minimum
  cacheable length); its TTL is scaled by ``ttl_scale`` (a test's 5 minutes in seconds).
- When a request leaves the pool (finished or preempted) the blocks of its runs are kept in
  the pool (``BlockPool.retain``: evicted after every unkept block, on the tenant's account
  and within its cap) until now + the run's TTL: each request that hits them refreshes them.
  Its saves to the tiers are cut at the runs' ends and written with the run's TTL, and the
  entries of its runs the tiers hold already are kept that long again (``keep_stored``). Its
  lookup refreshes the kept blocks it reaches under its breakpoints at once, so a prefix
  in use by a long request does not run out under the next one.
- Each kept block's hash is in the ``KeepLedger`` with its deadline. A request whose prefix
  reaches a block whose deadline has passed reads none of it from that block on: the free
  copies are dropped from the pool, the tiers' copies are not loaded
  (``Request.hit_limit_blocks``), and the request computes them again (created again, as
  Anthropic's expired entry is). The ledger then forgets them: from there on they are plain
  LRU blocks until a breakpoint keeps them again.
- ``created_tokens``: the prompt tokens a request computed (not read from the pool or the
  tiers) that lie in its runs, by the TTL asked (the report's class).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvwise.core.block_pool import BlockPool, KVBlock
from kvwise.core.hashing import BlockHash
from kvwise.core.kv_tiers import ChunkWrite, KVTierPlanner
from kvwise.core.request import Request

MAX_LEDGER_BLOCKS = 1 << 16  # kept block hashes remembered (oldest forgotten first)


@dataclass(frozen=True)
class KeepRun:
    """Blocks ``[start_block, end_block)`` (of ``block_size`` tokens) kept ``ttl_s``
    (scaled) under a breakpoint whose TTL was asked as ``ttl_class_s``."""

    start_block: int
    end_block: int
    ttl_s: float
    ttl_class_s: float
    block_size: int


@dataclass(frozen=True)
class BreakpointPolicy:
    """The engine's rules for breakpoints: ``min_tokens`` (below it a breakpoint keeps
    nothing) and ``ttl_scale`` (every TTL multiplied by it; 1.0 in production)."""

    min_tokens: int = 1024
    ttl_scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise ValueError(f"cache_min_tokens: expected an integer, got {self.min_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"cache_min_tokens: must be >= 0, got {self.min_tokens}")
        scale = self.ttl_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"cache_ttl_scale: expected a number, got {scale!r}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"cache_ttl_scale: must be a finite number > 0, got {scale}")

    def runs(self, request: Request, block_size: int) -> tuple[KeepRun, ...]:
        """The request's keep runs, in prompt order (non-increasing TTL)."""
        spans = []  # (end block, ttl_s, ttl_class_s)
        for bp in request.options.cache_breakpoints:
            if bp.num_tokens < self.min_tokens:
                continue
            end = min(bp.num_tokens, request.num_prompt_tokens) // block_size
            if end > 0:
                spans.append((end, bp.ttl_s * self.ttl_scale, bp.ttl_s))
        spans.sort()
        runs: list[KeepRun] = []
        start = 0
        for i, (end, _, _) in enumerate(spans):
            if end <= start:
                continue
            # the longest TTL of the breakpoints covering these blocks (those ending at or
            # after ``end``)
            ttl_s, ttl_class_s = max((t, c) for _, t, c in spans[i:])
            if runs and runs[-1].ttl_s == ttl_s and runs[-1].ttl_class_s == ttl_class_s:
                runs[-1] = KeepRun(runs[-1].start_block, end, ttl_s, ttl_class_s, block_size)
            else:
                runs.append(KeepRun(start, end, ttl_s, ttl_class_s, block_size))
            start = end
        return tuple(runs)


class KeepLedger:
    """Kept block hashes → when their keep runs out (pool clock), bounded, oldest forgotten
    first (a forgotten block is plain LRU)."""

    def __init__(self, max_blocks: int = MAX_LEDGER_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._until: OrderedDict[BlockHash, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def keep(self, block_hashes: Sequence[BlockHash], until: float) -> None:
        for h in block_hashes:
            self._until[h] = max(until, self._until.pop(h, until))
        while len(self._until) > self.max_blocks:
            self._until.popitem(last=False)

    def first_expired(self, block_hashes: Sequence[BlockHash], now: float) -> int | None:
        """The index of the first hash whose keep ran out, or None."""
        until = self._until
        for i, h in enumerate(block_hashes):
            t = until.get(h)
            if t is not None and t <= now:
                return i
        return None

    def refresh(self, block_hashes: Sequence[BlockHash], until: float) -> None:
        """Extend the keeps of those of ``block_hashes`` that are kept to ``until``."""
        kept = self._until
        for h in block_hashes:
            if h in kept:
                kept[h] = max(kept[h], until)

    def forget(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            self._until.pop(h, None)


class BreakpointKeeper:
    """The breakpoints' side of ``KVCacheManager``: keep runs per request, keeps in the pool
    and the ledger, expiry at lookup. See the module docstring."""

    def __init__(self, pool: BlockPool, block_size: int, policy: BreakpointPolicy) -> None:
        self.pool = pool
        self.block_size = block_size
        self.policy = policy
        self.ledger = KeepLedger()
        self.num_expired = 0  # lookups that found a breakpoint's keep run out

    def runs(self, request: Request) -> tuple[KeepRun, ...]:
        """The request's keep runs (computed once, on the request)."""
        if request.keep_runs is None:
            request.keep_runs = self.policy.runs(request, self.block_size)
        return request.keep_runs

    def expire(self, request: Request, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Before a lookup of ``request``'s prefix (``block_hashes``, group 0's): from the
        first block whose keep ran out, forget the keeps and limit the request's hit (device
        and tiers) to the blocks before it; the kept blocks it reaches before that under its
        own breakpoints are refreshed now (a hit refreshes, even while the request runs).
        Returns the hashes from there on (the caller drops their free copies)."""
        runs = self.runs(request)
        if not len(self.ledger):
            return []
        now = self.pool.clock()
        i = self.ledger.first_expired(block_hashes, now)
        limit = len(block_hashes) if i is None else i
        for run in runs:
            end = min(run.end_block, limit)
            self.ledger.refresh(block_hashes[run.start_block : end], now + run.ttl_s)
        if i is None:
            return []
        expired = list(block_hashes[i:])
        self.ledger.forget(expired)
        self.num_expired += 1
        request.hit_limit_blocks = i
        return expired

    def keep(self, request: Request, tables: list[list[KVBlock]]) -> None:
        """``request`` leaves the pool: keep the blocks of its runs that it computed or read
        (every group's; not the null block) until now + each run's TTL. Its hit limit goes
        (what it computed is cached now)."""
        request.hit_limit_blocks = None
        runs = request.keep_runs
        if not runs:
            return
        now = self.pool.clock()
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        null = self.pool.null_block
        for run in runs:
            end = min(run.end_block, num_full)
            if end <= run.start_block:
                break
            until = now + run.ttl_s
            self.ledger.keep(request.block_hashes[run.start_block : end], until)
            blocks = [b for t in tables for b in t[run.start_block : end] if b is not null]
            self.pool.retain(blocks, request.tenant, until)


def created_tokens(request: Request) -> dict[float, int]:
    """Prompt tokens ``request`` computed (past what it read: ``num_cached_tokens``) that lie
    in its keep runs, by the TTL asked."""
    created: dict[float, int] = {}
    read = max(request.num_cached_tokens, 0)
    for run in request.keep_runs or ():
        start, end = max(run.start_block * run.block_size, read), run.end_block * run.block_size
        if end > start:
            created[run.ttl_class_s] = created.get(run.ttl_class_s, 0) + end - start
    return created


def keep_cuts(request: Request) -> tuple[int, ...]:
    """Where the tiers' entries should end so that each lies in one keep run."""
    return tuple(run.end_block for run in request.keep_runs or ())


def save_ttl(request: Request, end_block: int) -> float | None:
    """The TTL of a stored entry ending at ``end_block`` (exclusive): the longest of the
    request's retention and the keep run holding its last block (runs' TTLs do not grow
    along the prompt, so every block of the entry is kept at least that long)."""
    ttl = request.retention_s or 0.0
    for run in request.keep_runs or ():
        if run.start_block < end_block <= run.end_block:
            ttl = max(ttl, run.ttl_s)
    return ttl or None


def keep_stored(
    tiers: KVTierPlanner,
    request: Request,
    block_hashes: Sequence[BlockHash],
    num_full_blocks: int,
    cuts: Sequence[int],
    first_block: int = 0,
) -> None:
    """Before ``request``'s saves are planned: the entries of its sequence that the tiers hold
    already, kept again for ``save_ttl`` from now (a hit refreshes a breakpoint's or a
    retention's TTL in the tiers, which a save skips: they hold the entry)."""
    if not (request.keep_runs or request.retention_s):
        return
    by_ttl: dict[float, list[ChunkWrite]] = {}
    for chunk in tiers.plan_keeps(block_hashes, num_full_blocks, cuts, first_block):
        ttl_s = save_ttl(request, chunk.first_block + len(chunk.block_hashes))
        if ttl_s:
            by_ttl.setdefault(ttl_s, []).append(chunk)
    for ttl_s, chunks in by_ttl.items():
        tiers.keep(chunks, ttl_s, request.tenant)

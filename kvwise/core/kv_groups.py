"""One manager per KV group, each a kind of attention, behind ``KVCacheManager`` (which plays
vLLM's ``KVCacheCoordinator``: it asks every group and reconciles their answers). Pure Python.

A group's manager owns what its kind of layers do with a request's block table:

- ``FullGroup`` (full attention, window 0): a hit is the leading run of cached blocks; the
  table only grows at its end; it holds every block of the sequence.
- ``WindowGroup`` (a sliding window of ``window`` tokens): a hit may use any cached blocks as
  long as the next token's window is all cached; before the window the table points at the
  null block, and blocks that leave the window go back to the pool (``let_go``); growing fills
  the window's holes first.

The methods take and return ``KVBlock`` lists; the pool and its null block are shared by every
group (one pool of pages). A new kind of KV (latent attention's) is a manager of its own here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvwise.core.block_pool import BlockPool, KVBlock
from kvwise.core.hashing import BlockHash
from kvwise.core.kv_spec import first_window_block, held_blocks

GetCached = Callable[[BlockHash], KVBlock | None]


class FullGroup:
    """A group of full-attention layers (see the module docstring)."""

    window = 0

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def first_block(self, position: int) -> int:
        """The first block a query at ``position`` reads: 0."""
        return 0

    def found(self, hashes: Sequence[BlockHash], max_blocks: int, get: GetCached) -> list:
        """The group's cached blocks a hit of at most ``max_blocks`` could use: the leading
        run of cached ones."""
        blocks = []
        for h in hashes[:max_blocks]:
            block = get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def longest_hit(self, found: list, n: int) -> int:
        """The most blocks m <= n whose next token this group can serve from ``found``."""
        return min(n, len(found))

    def hit_table(self, found: list, n: int, null: KVBlock | None) -> list[KVBlock]:
        """The table of a hit of ``n`` blocks."""
        return list(found[:n])

    def held(self, table: list[KVBlock], null: KVBlock | None) -> int:
        """Blocks of ``table`` that are the request's own (not the null block)."""
        return len(table)

    def blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` holds while computing its last
        ``step_tokens``."""
        return held_blocks(0, self.block_size, num_tokens, step_tokens)

    def wanted(
        self, table: list[KVBlock], computed: int, loaded: int, num_required: int, num_old: int
    ) -> int:
        """Fresh blocks growing ``table`` to ``num_required`` blocks takes from the pool."""
        return max(0, num_required - len(table))

    def let_go(self, table: list[KVBlock], computed: int, released: list[int]) -> None:
        """Blocks before the window go back to the pool: none here."""

    def grow(self, table: list[KVBlock], start: int, num_required: int) -> list[KVBlock]:
        """``table`` grown to ``num_required`` blocks (fresh ones at the end)."""
        if num_required > len(table):
            return table + self.pool.get_new_blocks(num_required - len(table))
        return table


class WindowGroup(FullGroup):
    """A group of sliding-window layers of ``window`` tokens (see the module docstring)."""

    def __init__(self, pool: BlockPool, block_size: int, window: int) -> None:
        super().__init__(pool, block_size)
        self.window = window

    def first_block(self, position: int) -> int:
        return first_window_block(self.window, self.block_size, position)

    def found(self, hashes: Sequence[BlockHash], max_blocks: int, get: GetCached) -> list:
        """Every block up to ``max_blocks`` (None where not cached): the hit's window may
        lie anywhere."""
        return [get(h) for h in hashes[:max_blocks]]

    def longest_hit(self, found: list, n: int) -> int:
        """The most blocks m <= n whose next token's window (blocks ``first .. m - 1``) is
        all in ``found``."""
        run = 0  # cached blocks in a row ending at block m - 1
        runs = [0] * (n + 1)
        for m in range(1, n + 1):
            run = run + 1 if found[m - 1] is not None else 0
            runs[m] = run
        for m in range(n, 0, -1):
            if runs[m] >= m - self.first_block(m * self.block_size):
                return m
        return 0

    def hit_table(self, found: list, n: int, null: KVBlock | None) -> list[KVBlock]:
        first = self.first_block(n * self.block_size)
        return [null] * first + found[first:n]

    def held(self, table: list[KVBlock], null: KVBlock | None) -> int:
        return sum(1 for b in table if b is not null)

    def blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        return held_blocks(self.window, self.block_size, num_tokens, step_tokens)

    def wanted(
        self, table: list[KVBlock], computed: int, loaded: int, num_required: int, num_old: int
    ) -> int:
        """Fresh blocks: new ones, and real ones where the table holds the null block, less
        those it lets go first (before the window), unless another request holds them too (a
        revived one: back where it was)."""
        null = self.pool.null_block
        first = self.first_block(computed + loaded)
        wanted = max(0, num_required - max(len(table), first))
        wanted += sum(1 for b in table[first:num_required] if b is null)
        gone = table[: self.first_block(computed)]
        wanted -= sum(b is not null and b.ref_cnt == (i < num_old) for i, b in enumerate(gone))
        return wanted

    def let_go(self, table: list[KVBlock], computed: int, released: list[int]) -> None:
        """Free the blocks before the window of a query at ``computed`` and point the table
        at the null block there. They join the free queue in LRU order, as vLLM's do: freed
        before the rest of their sequence, they are evicted before it, and until then they
        still serve a hit whose window they lie in. ``released``: the ids of those freed
        before being cached."""
        first = self.first_block(computed)
        null = self.pool.null_block
        gone = [b for b in table[:first] if b is not null]
        if not gone:
            return
        released.extend(b.block_id for b in gone if b.block_hash is None)
        k = min(first, len(table))
        table[:k] = [null] * k
        self.pool.free_blocks(reversed(gone))

    def grow(self, table: list[KVBlock], start: int, num_required: int) -> list[KVBlock]:
        """``table`` grown to ``num_required`` blocks: the null block before the window of a
        query at ``start``, fresh blocks from there (also where the null block was)."""
        first = self.first_block(start)
        null = self.pool.null_block
        table = table + [null] * max(0, min(first, num_required) - len(table))
        holes = [i for i in range(first, min(len(table), num_required)) if table[i] is null]
        num_new = max(0, num_required - len(table))
        fresh = self.pool.get_new_blocks(len(holes) + num_new) if holes or num_new else []
        for i, block in zip(holes, fresh):
            table[i] = block
        return table + fresh[len(holes) :]


def make_group(pool: BlockPool, block_size: int, window: int) -> FullGroup:
    """The manager of a group of layers with ``window`` (0: full attention)."""
    return WindowGroup(pool, block_size, window) if window else FullGroup(pool, block_size)

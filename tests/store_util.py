"""Helpers shared by the tier tests that need no model (tests/unit, tests/integration)."""

from __future__ import annotations

import hashlib

from kvwise.store.host import HostStore
from kvwise.store.stats import TierStats
from kvwise.store.tiered import TieredStore


class FakeClock:
    """A clock the test moves by hand (``clock.t += 5``)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def key(i: int) -> bytes:
    """A 32-byte key, as a block hash would be."""
    return hashlib.sha256(str(i).encode()).digest()


def value(i: int, size: int = 100) -> bytes:
    """``size`` recognisable bytes for entry ``i``."""
    return (key(i) * (size // 32 + 1))[:size]


def entry_format(model: str = "model-x", layer_groups: int = 2):
    """2 layers, 1 KV head, head_dim 2, 4-token blocks, float32: 128-byte blocks, 32 bytes
    per block of K (or V) of one layer."""
    from kvwise.core.kv_spec import KVSpec
    from kvwise.store.serde import EntryFormat

    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, dtype="float32")
    return EntryFormat(spec, model, layer_groups=layer_groups)


def chain(n: int, tag: str = "a") -> list[bytes]:
    """``n`` 32-byte block hashes (a stand-in for a prompt's hash chain)."""
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


def fork(hashes: list[bytes], num_shared: int, tag: str) -> list[bytes]:
    """A sequence as long as ``hashes`` that shares its first ``num_shared`` blocks, then
    diverges: as in a real chain, every hash from the first differing block on differs."""
    return hashes[:num_shared] + chain(len(hashes), tag)[num_shared:]


def payload(hashes: list[bytes]) -> bytes:
    """A recognisable chunk payload for ``entry_format()``: each block's 128 bytes derive
    from its hash."""
    return b"".join(h * 4 for h in hashes)


class MemoryTier:
    """An in-memory tier, as a plug-in would provide one: the five batched methods of
    ``KVStore`` and ``describe``, no optional ability."""

    name = "mem"

    def __init__(self) -> None:
        self.stats = TierStats()
        self.entries: dict[bytes, bytes] = {}

    def contains(self, keys):
        return [k in self.entries for k in keys]

    def get(self, keys):
        return [self.entries.get(k) for k in keys]

    def put(self, items, ttl_s=None, owner=None) -> None:
        for key, value in items:
            self.entries[key] = bytes(value)
            self.stats.bytes_written += len(value)

    def delete(self, keys) -> None:
        for key in keys:
            self.entries.pop(key, None)

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"mem ({len(self.entries)} entries)"


FMT = entry_format()  # 2 layers in 2 groups, 4-token blocks of 128 bytes


class Flaky(HostStore):
    """A host tier that can fail every call (as a dead server would)."""

    def __init__(self, name: str) -> None:
        super().__init__(1 << 20)
        self.name = name
        self.down = False

    def get(self, keys):
        if self.down:
            self.stats.faults += 1
            return [None] * len(keys)
        return super().get(keys)


def make_store(*tiers, chunk_blocks=4, min_tokens=4, policy="always") -> TieredStore:
    return TieredStore(
        list(tiers),
        FMT,
        chunk_blocks=chunk_blocks,
        min_tokens=min_tokens,
        policy=policy,
        background=False,
    )


def load(store: TieredStore, hashes, device: int, max_blocks: int, prompt_tokens: int,
         dest_for=None):  # fmt: skip
    """Plan a load and read every layer group, as the engine's loader does (without torch);
    ``dest_for(plan)`` gives the ``dest`` to read into (None: into memory).

    Returns (plan, blocks loaded, reads per group)."""
    plan = store.plan_load("r", hashes, device, max_blocks, prompt_tokens)
    if plan is None:
        return None, 0, []
    dest = dest_for(plan) if dest_for else None
    loaded = [ch.num_blocks for ch in plan.chunks]
    reads = []
    for g in range(store.layer_groups):
        got = store.read_group(plan.chunks, g, dest)
        reads.append(got)
        for i, r in enumerate(got):
            loaded[i] = min(loaded[i], r.usable)
    total = 0
    for ch, n in zip(plan.chunks, loaded):
        total += n
        if n < ch.num_blocks:
            break
    return plan, total, reads


def write_all(store: TieredStore, hashes: list[bytes], ttl_s=None, cuts=()) -> list:
    writes = store.plan_writes(hashes, len(hashes), cuts)
    for w in writes:
        store.write(w, payload(list(w.block_hashes)), ttl_s)
    return writes

"""A model-free runner for tests of the scheduler, the engine, the async engine and the server.
No torch.

Its KV cache is real bytes laid out as its ``KVSpec`` says (``num_layers`` layers, one KV head
of dimension one, float32): every layer's K and V slot of a token hold that token's id (plus
one, so that 0 means "never written"). The next token is a hash of the whole context read back
through the block tables from every layer, so a wrong block table, slot mapping, a missing or
wrong load from the tiers changes its output just as it would a real model's. It implements
the runner contract of ``model_runner.py``, loads and saves included, so a whole engine with
tiers runs on it in milliseconds.
"""

from __future__ import annotations

import hashlib
import struct

from kvwise.core.kv_spec import KVSpec
from kvwise.core.outputs import ModelOutput, SchedulerOutput


class FakeModelRunner:
    """A model-free runner whose next token is a hash of the whole context read from slots."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        num_layers: int = 2,
        skips_cached_writes: bool = True,
    ) -> None:
        self.spec = KVSpec(num_layers, 1, 1, block_size, "float32")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.reads_in_place = True
        # (layers, 2, num_blocks, block_size) float32 slots
        self.kv = bytearray(num_blocks * self.spec.block_bytes)
        self._slots = memoryview(self.kv).cast("f")
        self.num_tokens_computed = 0
        self.skips_cached_writes = skips_cached_writes

    def _index(self, layer: int, kv: int, slot: int) -> int:
        return (layer * 2 + kv) * self.num_blocks * self.block_size + slot

    def _slot(self, block_ids: list[int], pos: int) -> int:
        bs = self.block_size
        return block_ids[pos // bs] * bs + pos % bs

    def execute(self, sched_out: SchedulerOutput, layer_ready=None) -> ModelOutput:
        for layer in range(self.num_layers):
            if layer_ready is not None:
                layer_ready(layer)
            for item in sched_out.scheduled:
                for i, token_id in enumerate(item.token_ids):
                    if i < item.kv_in_pool and self.skips_cached_writes:
                        continue  # the pool holds it (a whole-prompt hit's last token)
                    slot = self._slot(item.block_ids, item.start_pos + i)
                    for kv in (0, 1):
                        self._slots[self._index(layer, kv, slot)] = token_id + 1
        out = ModelOutput()
        for item in sched_out.scheduled:
            self.num_tokens_computed += item.num_tokens
            if not item.sample:
                continue
            ctx_len = item.start_pos + item.num_tokens
            context = [
                self._slots[self._index(layer, kv, self._slot(item.block_ids, p))]
                for layer in range(self.num_layers)
                for kv in (0, 1)
                for p in range(ctx_len)
            ]
            digest = hashlib.sha256(struct.pack(f"<{len(context)}f", *context)).digest()
            out.sampled[item.request_id] = (
                int.from_bytes(digest[:4], "little") % self.vocab_size,
                0.0,
            )
        return out

    # ---- block copies for the tiers (layout: (layers, 2, num_blocks, block_size)) -------

    def _run(self, layer: int, kv: int, block_id: int, count: int = 1) -> slice:
        """Bytes of ``count`` consecutive blocks of one layer's K or V."""
        start = self._index(layer, kv, block_id * self.block_size) * 4
        return slice(start, start + count * self.spec.half_block_bytes)

    def save_kv(self, block_ids: list[int]) -> bytes:
        return b"".join(
            self.kv[self._run(layer, kv, b)]
            for layer in range(self.num_layers)
            for kv in (0, 1)
            for b in block_ids
        )

    def write_kv(
        self, block_ids: list[int], payload, num_entry_blocks: int, skip: int, layers
    ) -> int:
        first_layer, num_layers = layers
        src, half = memoryview(payload).cast("B"), self.spec.half_block_bytes
        for i, layer in enumerate(range(first_layer, first_layer + num_layers)):
            for kv in (0, 1):
                row = (i * 2 + kv) * num_entry_blocks
                for j, block_id in enumerate(block_ids):
                    at = (row + skip + j) * half
                    self.kv[self._run(layer, kv, block_id)] = src[at : at + half]
        return len(block_ids) * num_layers * self.spec.layer_block_bytes

    def payload_views(
        self, block_ids: list[int], skip: int, num_entry_blocks: int, layers: tuple[int, int]
    ) -> list[memoryview]:
        first_layer, num_layers = layers
        half, tail = self.spec.half_block_bytes, num_entry_blocks - skip - len(block_ids)
        raw, views = memoryview(self.kv), []
        for layer in range(first_layer, first_layer + num_layers):
            for kv in (0, 1):
                if skip:
                    views.append(memoryview(bytearray(skip * half)))
                views += [raw[self._run(layer, kv, b)] for b in block_ids]
                if tail > 0:
                    views.append(memoryview(bytearray(tail * half)))
        return views

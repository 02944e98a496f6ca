"""The paged KV pool: per layer and K/V, ``num_blocks`` blocks of ``block_size`` slots.

Block ``b`` of the core's pool is ``[:, :, b]`` here. Slot ``s`` (a token's place in the pool)
is block ``s // block_size``, offset ``s % block_size``. The layout, the storage dtype and the
bytes of one block come from a ``KVSpec``:

- float formats: ``kv`` ``(layers, 2, num_blocks, block_size, kv_heads, head_dim)``; when the
  storage dtype differs from the model's compute dtype, K/V are cast on the way in (``write``)
  and back on the way out (``gather``);
- quantized formats (``int8``, ``int4``): each block's K (and V) is one run of bytes, its
  codes then their scales (``raw`` ``(layers, 2, num_blocks, half_block_bytes)`` uint8), with
  typed views of both; rows are quantized as they are written (``kv_quant``) and dequantized
  as they are gathered.
- ``int4`` keys are quantized per channel over the whole block, so a block's keys are written
  when it is full ("sealed"). Until then its rows wait in ``staged``, full precision, one
  slot per open block; attention reads a query's own block from there
  (``open_keys``, ``decode_open_keys``). A sealed block's slot lives until the next step
  (that step's attention still reads it); a slot is released when the core frees its block
  (``begin_step``) or reused when its block's first row is written again.

Either way ``raw`` is the pool as bytes, in the order the tiers store it.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

import torch

from kvwise import kernels
from kvwise.core.kv_spec import KVSpec
from kvwise.worker import kv_quant

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PagedKVCache:
    def __init__(
        self, spec: KVSpec, num_blocks: int, compute_dtype: torch.dtype | None = None
    ) -> None:
        if spec.dtype not in TORCH_DTYPES and not spec.quantized:
            raise ValueError(f"kv_cache_dtype: the paged cache cannot hold {spec.layout}")
        self.spec = spec
        self.num_layers = spec.num_layers
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.quantized = spec.quantized
        self.dtype = TORCH_DTYPES.get(spec.dtype, torch.uint8)
        self.compute_dtype = compute_dtype or (torch.float32 if self.quantized else self.dtype)
        self._cast = (
            self.compute_dtype != self.dtype and not self.quantized
        )  # NOTE: off the usual path
        # attention reads back what was stored (not the fresh rows) whenever storing loses
        # anything: a prompt then sees the same K/V cold as from the cache
        self.lossy = self.quantized or self._cast
        heads, dim = spec.num_kv_heads, spec.head_dim
        shape = (spec.num_layers, 2, num_blocks, spec.half_block_bytes)
        self._write_int8 = None
        if self.quantized:
            self.kv = None
            self.raw = torch.zeros(shape, dtype=torch.uint8)
            # [layer][0 = K, 1 = V]: typed views of the codes and the scales of every block
            halves = [[self._typed_views(self.raw[i, kv], kv) for kv in (0, 1)]
                      for i in range(spec.num_layers)]  # fmt: skip
            self.codes = [[h[0] for h in layer] for layer in halves]
            self.scales = [[h[1] for h in layer] for layer in halves]
            self.k_blocks = [self.raw[i, 0] for i in range(spec.num_layers)]
            self.v_blocks = [self.raw[i, 1] for i in range(spec.num_layers)]
            # int8 rows are quantized by the C++ op where it is built (the same bytes)
            self._write_int8 = (
                torch.ops.kvwise.kv_write_int8.default
                if spec.dtype == "int8" and kernels.available()
                else None
            )
            if spec.sealed_keys:
                self._init_staging()
            return
        # (layers, 2, num_blocks, block_size, kv_heads, head_dim)
        self.kv = torch.zeros(spec.cache_shape(num_blocks), dtype=self.dtype)
        self.raw = self.kv.view(torch.uint8).view(shape)
        # per-layer views: (num_blocks, block_size, kv_heads, head_dim), and with slots flattened
        self.k_blocks = [self.kv[i, 0] for i in range(spec.num_layers)]
        self.v_blocks = [self.kv[i, 1] for i in range(spec.num_layers)]
        self.k_slots = [self.kv[i, 0].view(-1, heads, dim) for i in range(spec.num_layers)]
        self.v_slots = [self.kv[i, 1].view(-1, heads, dim) for i in range(spec.num_layers)]

    def _typed_views(self, half: torch.Tensor, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of one layer's K (``kv`` 0) or V (1) block halves, ``half``
        ``(num_blocks, half_block_bytes)`` uint8, in the layouts ``KVSpec`` documents."""
        spec = self.spec
        cb, bs, heads, dim = spec.codes_bytes, spec.block_size, spec.num_kv_heads, spec.head_dim
        if spec.dtype == "int8":
            codes = half[:, :cb].view(torch.int8).view(-1, bs, heads, dim)
            return codes, half[:, cb:].view(torch.float32).view(-1, bs, heads)
        if kv == 0:  # int4 keys: per channel over the block
            scales = half[:, cb : cb + spec.key_scale_bytes].view(torch.float16)
            return half[:, :cb].view(-1, heads, dim, bs // 2), scales.view(-1, heads, dim, 2)
        # int4 values: per token, in groups of channels
        scales = half[:, cb : cb + spec.value_scale_bytes].view(torch.float16)
        groups = dim // spec.group_size
        return half[:, :cb].view(-1, bs, heads, dim // 2), scales.view(-1, bs, heads, groups, 2)

    def _init_staging(self) -> None:
        """int4: the full-precision key rows of open blocks, a slot each (grown on demand)."""
        spec = self.spec
        # (layers, slot, block_size, kv_heads, head_dim); zeros: rows a decode has not reached
        # are masked, but must be finite (NaN * 0 is NaN)
        self.staged = torch.zeros(spec.num_layers, 8, *spec.block_shape)
        self._slots: dict[int, int] = {}  # open block id -> its staging slot
        self._free_slots = list(range(7, -1, -1))
        self._sealed: list[int] = []  # blocks sealed this step: slots freed next step
        self._opened: list[int] = []  # blocks whose first row went to staging this step
        self._plan_key: torch.Tensor | None = None
        self._plan: _WritePlan | None = None
        self._slots_key: list[int] | None = None  # see slots_of
        self._slots_tensor: torch.Tensor | None = None
        # values and staging written by a C++ op where it is built (the same bytes)
        self._int4_write_op = (
            torch.ops.kvwise.kv_write_int4.default if kernels.available() else None
        )

    @property
    def num_bytes(self) -> int:
        return self.raw.numel()

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store new K/V rows ``(T, kv_heads, head_dim)`` at their slots ``(T,)``."""
        if self._write_int8 is not None:
            self._write_int8(self.k_blocks[layer], self.v_blocks[layer], k, v, slot_mapping,
                             self.block_size)  # fmt: skip
            return
        if self.spec.sealed_keys:
            self._write_int4(layer, slot_mapping, k, v)
            return
        if self.quantized:
            blocks = slot_mapping // self.block_size
            offsets = slot_mapping % self.block_size
            for half, x in ((0, k), (1, v)):
                codes, scales = kv_quant.quantize(x.float(), self.spec.dtype, self.spec.group_size)
                self.codes[layer][half][blocks, offsets] = codes
                self.scales[layer][half][blocks, offsets] = scales
            return
        if self._cast:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k_slots[layer].index_copy_(0, slot_mapping, k)
        self.v_slots[layer].index_copy_(0, slot_mapping, v)

    def gather(
        self, layer: int, block_table: torch.Tensor, first_block: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the blocks in ``block_table`` ``(B, max_blocks)`` as
        ``(B, max_blocks * block_size, kv_heads, head_dim)`` each, in the compute dtype.

        ``first_block`` says the table is one row of consecutive ids starting there: for a
        float32 pool the result is then a view of the cache, with no copy.
        """
        b, nb = block_table.shape
        shape = (b, nb * self.block_size, self.num_kv_heads, self.head_dim)
        if self.quantized:
            ids = block_table.reshape(-1)
            out = []
            for half in (0, 1):
                codes = self.codes[layer][half].index_select(0, ids)
                scales = self.scales[layer][half].index_select(0, ids)
                if self.spec.sealed_keys and half == 0:
                    x = kv_quant.dequantize_int4_keys(codes, scales)
                else:
                    x = kv_quant.dequantize(codes, scales, self.spec.dtype, self.spec.group_size)
                out.append(x.reshape(shape))
            return out[0], out[1]
        if first_block is not None:
            shape = (1, nb * self.block_size, self.num_kv_heads, self.head_dim)
            k = self.kv[layer, 0, first_block : first_block + nb]
            v = self.kv[layer, 1, first_block : first_block + nb]
        else:
            # NOTE: index_select on a flat id list is ~2.5x faster than advanced indexing here.
            ids = block_table.reshape(-1)
            k = self.kv[layer, 0].index_select(0, ids)  # (B * max_blocks, block_size, kv_heads, D)
            v = self.kv[layer, 1].index_select(0, ids)
        k, v = k.view(shape), v.view(shape)
        if self._cast:
            k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v

    # ---- int4: keys sealed per block ---------------------------------------------------

    def begin_step(self, released_block_ids: list[int] = ()) -> None:
        """Before a step: free the staging slots of blocks sealed in the last step and of
        open blocks the core has freed since.

        NOTE: the core reports a block freed while it schedules a step (a preempted request's)
        with the NEXT step, and may have handed it to another request in the same step, which
        then wrote its first row: a release of a block opened in the last step may be that
        stale one, so it is skipped once (a real one only keeps the slot until the block's
        first row is written again, which reuses it)."""
        if not self.spec.sealed_keys:
            return
        stale = Counter(self._opened)
        for block_id in released_block_ids:
            if stale[block_id]:
                stale[block_id] -= 1
                continue
            self._release_slot(block_id)
        for block_id in self._sealed:
            self._release_slot(block_id)
        self._sealed = []
        self._opened = []

    def _release_slot(self, block_id: int) -> None:
        slot = self._slots.pop(block_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _write_int4(self, layer: int, slot_mapping: torch.Tensor, k, v) -> None:
        if slot_mapping is not self._plan_key:  # the same plan serves every layer of a step
            self._plan = self._plan_writes(slot_mapping.tolist())
            self._plan_key = slot_mapping
        plan = self._plan
        k = k.float()
        staged = self.staged[layer]  # (slots, block_size, kv_heads, head_dim)
        if self._int4_write_op is not None:  # values and staging in one C++ call, same bytes
            self._int4_write_op(self.v_blocks[layer], staged, k, v, slot_mapping, plan.stage_index,
                             self.block_size, self.spec.group_size)  # fmt: skip
        else:
            blocks = slot_mapping // self.block_size
            offsets = slot_mapping % self.block_size
            codes, scales = kv_quant.quantize_int4(v.float(), self.spec.group_size)
            self.codes[layer][1][blocks, offsets] = codes
            self.scales[layer][1][blocks, offsets] = scales
            if plan.stage_rows is not None:
                staged.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                    0, plan.stage_dst, k.index_select(0, plan.stage_rows)
                )
        parts = []
        if plan.direct_rows is not None:  # blocks written whole in this step
            parts.append(k.index_select(0, plan.direct_rows).view(-1, *self.spec.block_shape))
        if plan.seal_slots is not None:  # blocks completed from their staged rows
            parts.append(staged.index_select(0, plan.seal_slots))
        if parts:
            full = parts[0] if len(parts) == 1 else torch.cat(parts)
            codes, scales = kv_quant.quantize_int4_keys(full)
            self.codes[layer][0][plan.seal_blocks] = codes
            self.scales[layer][0][plan.seal_blocks] = scales

    def _plan_writes(self, slots: list[int]) -> _WritePlan:
        """Where one step's rows go: blocks written whole are sealed from the rows at once;
        rows of open blocks go to their staging slots (a block's first row takes a slot), and
        a block their rows complete is sealed from its slot."""
        bs = self.block_size
        direct, stage_rows, stage_dst, seal_slots, seal_direct, seal_staged = [], [], [], [], [], []
        i, n = 0, len(slots)
        while i < n:
            block, first = divmod(slots[i], bs)
            j = i + 1
            while j < n and slots[j] == slots[j - 1] + 1 and slots[j] % bs:
                j += 1
            count = j - i
            full = first + count == bs
            if first == 0 and full:
                direct.extend(range(i, j))
                seal_direct.append(block)
            else:
                if first == 0:
                    self._opened.append(block)
                    slot = self._slots.get(block)
                    if slot is None:
                        slot = self._take_slot()
                        self._slots[block] = slot
                else:
                    slot = self._slots.get(block)
                    if slot is None:
                        raise RuntimeError(f"block {block}: rows from offset {first} were "
                                           f"written, but its first rows never were")  # fmt: skip
                stage_rows.extend(range(i, j))
                stage_dst.extend(range(slot * bs + first, slot * bs + first + count))
                if full:
                    seal_slots.append(slot)
                    seal_staged.append(block)
            if full:
                self._sealed.append(block)
            i = j

        def tensor(values: list[int]) -> torch.Tensor | None:
            return torch.tensor(values, dtype=torch.long) if values else None

        stage_index = [-1] * n  # each row's flat staging place, -1: none (for the C++ write)
        for row, dst in zip(stage_rows, stage_dst, strict=True):
            stage_index[row] = dst
        return _WritePlan(
            stage_index=torch.tensor(stage_index, dtype=torch.long),
            direct_rows=tensor(direct),
            stage_rows=tensor(stage_rows),
            stage_dst=tensor(stage_dst),
            seal_slots=tensor(seal_slots),
            seal_blocks=tensor(seal_direct + seal_staged),
        )

    def _take_slot(self) -> int:
        if not self._free_slots:  # grow the staging area (doubling)
            old = self.staged
            grown = torch.zeros(old.shape[0], old.shape[1] * 2, *old.shape[2:])
            grown[:, : old.shape[1]] = old
            self.staged = grown
            self._free_slots = list(range(grown.shape[1] - 1, old.shape[1] - 1, -1))
        return self._free_slots.pop()

    def open_keys(self, layer: int, block_id: int, rows: int) -> torch.Tensor:
        """The first ``rows`` staged (full-precision) keys of an open block ``(rows, kv_heads,
        head_dim)``."""
        return self.staged[layer, self._slots[block_id], :rows]

    def slots_of(self, block_ids: list[int]) -> torch.Tensor:
        """The staging slots of open blocks ``(B,)``, cached for the step (every layer asks)."""
        if self._slots_key is not block_ids:
            self._slots_key = block_ids
            self._slots_tensor = torch.tensor([self._slots[b] for b in block_ids])
        return self._slots_tensor

    def decode_open_keys(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """The staged keys of each decode's own block ``(B, block_size, kv_heads, head_dim)``
        (rows past a decode's position are stale: attention masks them)."""
        return self.staged[layer].index_select(0, self.slots_of(block_ids))

    # ---- block copies for the slower tiers ----------------------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of blocks as bytes ``(layers, 2, len(block_ids), half_block_bytes)``."""
        first = first_if_consecutive(block_ids)
        if first is not None:
            return self.raw[:, :, first : first + len(block_ids)].contiguous()
        return self.raw[:, :, torch.tensor(block_ids)]  # advanced indexing copies

    def write_blocks(
        self,
        block_ids: list[int],
        payload,
        num_entry_blocks: int,
        skip: int,
        layers: tuple[int, int],
    ) -> None:
        """Copy blocks ``skip .. skip + len(block_ids)`` of a stored payload into ``block_ids``.

        ``payload`` is a buffer laid out ``(num_layers, 2, num_entry_blocks, half_block_bytes)``
        for the ``num_layers`` layers starting at ``layers[0]``.
        """
        first_layer, num_layers = layers
        with warnings.catch_warnings():  # read-only buffers are fine: we only read them
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(payload, dtype=torch.uint8)
        shape = (num_layers, 2, num_entry_blocks, self.spec.half_block_bytes)
        src = src.view(shape)[:, :, skip : skip + len(block_ids)]
        dst = self.raw[first_layer : first_layer + num_layers]
        first = first_if_consecutive(block_ids)
        if first is not None:
            dst[:, :, first : first + len(block_ids)].copy_(src)
        else:
            dst[:, :, torch.tensor(block_ids)] = src

    def payload_views(
        self, block_ids: list[int], skip: int, num_entry_blocks: int, layers: tuple[int, int]
    ) -> list[memoryview]:
        """Writable buffers, in a stored payload's byte order, that put the entry's blocks
        ``skip .. skip + len(block_ids)`` straight into ``block_ids`` (the entry's other
        blocks land in a scratch buffer). For reading an entry with no intermediate copy.
        """
        first_layer, num_layers = layers
        n, tail = len(block_ids), num_entry_blocks - skip - len(block_ids)
        block_bytes = self.spec.half_block_bytes
        scratch = memoryview(bytearray((skip + max(tail, 0)) * block_bytes * 2 * num_layers))
        runs, j = [], 0  # (first id, count) of consecutive ids
        while j < n:
            k = j
            while k + 1 < n and block_ids[k + 1] == block_ids[k] + 1:
                k += 1
            runs.append((block_ids[j], k - j + 1))
            j = k + 1
        raw = self.raw
        views, used = [], 0
        for layer in range(first_layer, first_layer + num_layers):
            for kv in (0, 1):
                if skip:
                    views.append(scratch[used : used + skip * block_bytes])
                    used += skip * block_bytes
                for first, count in runs:
                    views.append(
                        memoryview(raw[layer, kv, first : first + count].numpy()).cast("B")
                    )
                if tail > 0:
                    views.append(scratch[used : used + tail * block_bytes])
                    used += tail * block_bytes
        return views


@dataclass
class _WritePlan:
    """Row indices (into one step's rows) and block ids of an int4 write; None: none."""

    stage_index: torch.Tensor  # (T,) each row's flat staging place, -1 where it has none
    direct_rows: torch.Tensor | None  # rows of blocks written whole, block by block
    stage_rows: torch.Tensor | None  # rows going to staging slots...
    stage_dst: torch.Tensor | None  # ...at these flat (slot * block_size + offset) places
    seal_slots: torch.Tensor | None  # slots of staged blocks this step completes
    seal_blocks: torch.Tensor | None  # blocks sealed: the direct ones, then the staged ones


def first_if_consecutive(block_ids: list[int]) -> int | None:
    """The first id when ``block_ids`` are consecutive ascending ids (the cache can then be
    sliced instead of gathered), else None."""
    if block_ids and block_ids[-1] - block_ids[0] == len(block_ids) - 1:
        if all(b == block_ids[0] + i for i, b in enumerate(block_ids)):
            return block_ids[0]
    return None

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

Either way ``raw`` is the pool as bytes, in the order the tiers store it.
"""

from __future__ import annotations

import warnings

import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.worker import kernels, kv_quant

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
            self.codes, self.scales = [], []  # [layer][0 = K, 1 = V]: (blocks, block_size, ...)
            cb, bs = spec.codes_bytes, spec.block_size
            for i in range(spec.num_layers):
                codes, scales = [], []
                for kv in (0, 1):
                    half = self.raw[i, kv]  # (num_blocks, half_block_bytes)
                    if spec.dtype == "int8":
                        codes.append(half[:, :cb].view(torch.int8).view(-1, bs, heads, dim))
                        scales.append(half[:, cb:].view(torch.float32).view(-1, bs, heads))
                    else:
                        groups = dim // spec.group_size
                        codes.append(half[:, :cb].view(-1, bs, heads, dim // 2))
                        scales.append(
                            half[:, cb:].view(torch.float16).view(-1, bs, heads, groups, 2)
                        )
                self.codes.append(codes)
                self.scales.append(scales)
            self.k_blocks = [self.raw[i, 0] for i in range(spec.num_layers)]
            self.v_blocks = [self.raw[i, 1] for i in range(spec.num_layers)]
            # int8 rows are quantized by the C++ op where it is built (the same bytes)
            self._write_int8 = (
                torch.ops.kvwise.kv_write_int8.default
                if spec.dtype == "int8" and kernels.available()
                else None
            )
            return
        # (layers, 2, num_blocks, block_size, kv_heads, head_dim)
        self.kv = torch.zeros(spec.cache_shape(num_blocks), dtype=self.dtype)
        self.raw = self.kv.view(torch.uint8).view(shape)
        # per-layer views: (num_blocks, block_size, kv_heads, head_dim), and with slots flattened
        self.k_blocks = [self.kv[i, 0] for i in range(spec.num_layers)]
        self.v_blocks = [self.kv[i, 1] for i in range(spec.num_layers)]
        self.k_slots = [self.kv[i, 0].view(-1, heads, dim) for i in range(spec.num_layers)]
        self.v_slots = [self.kv[i, 1].view(-1, heads, dim) for i in range(spec.num_layers)]

    @property
    def num_bytes(self) -> int:
        return self.raw.numel()

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store new K/V rows ``(T, kv_heads, head_dim)`` at their slots ``(T,)``."""
        if self._write_int8 is not None:
            self._write_int8(self.k_blocks[layer], self.v_blocks[layer], k, v, slot_mapping,
                             self.block_size)  # fmt: skip
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
                x = kv_quant.dequantize(codes, scales, self.spec.dtype, self.spec.group_size)
                out.append(x.view(shape))
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


def first_if_consecutive(block_ids: list[int]) -> int | None:
    """The first id when ``block_ids`` are consecutive ascending ids (the cache can then be
    sliced instead of gathered), else None."""
    if block_ids and block_ids[-1] - block_ids[0] == len(block_ids) - 1:
        if all(b == block_ids[0] + i for i, b in enumerate(block_ids)):
            return block_ids[0]
    return None

"""The float formats' pool (``float32``, ``bfloat16``, ``float16``): ``kv`` ``(layers, 2,
num_blocks, block_size, kv_heads, head_dim)`` in the storage dtype. When it differs from the
model's compute dtype, K/V are cast on the way in (``write``) and back on the way out
(``gather``), and the pool is lossy. The paged kernel (``csrc/paged_attention.cpp``) reads all
three dtypes where they lie; a float32 pool's decode-only step writes and attends in one call.
"""

from __future__ import annotations

import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.worker.attention_metadata import AttentionMetadata, LayerAttention
from kvwise.worker.kv_cache.base import TORCH_DTYPES, PagedKVCache, kind_args, zeroed_pool


class FloatKVCache(PagedKVCache):
    """K/V as floats. ``storage_dtype``: a subclass's fixed torch dtype (a format of another
    name with a float layout); None: the spec's dtype name."""

    storage_dtype: torch.dtype | None = None
    skips_writes = True

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        compute_dtype: torch.dtype | None = None,
        use_kernels: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        dtype = self.storage_dtype or TORCH_DTYPES[spec.dtype]
        if dtype.itemsize != spec.itemsize:
            raise ValueError(
                f"kv_cache_dtype: {spec.dtype} has {spec.itemsize} bytes a value, {dtype} "
                f"{dtype.itemsize}"
            )
        super().__init__(spec, num_blocks, compute_dtype or dtype, use_kernels, device)
        self.dtype = dtype
        self._cast = self.compute_dtype != dtype  # NOTE: off the usual path
        self.lossy = self._cast
        heads, dim, layers = spec.num_kv_heads, spec.head_dim, range(spec.num_layers)
        # (layers, 2, num_blocks, block_size, kv_heads, head_dim)
        self.kv = zeroed_pool(spec.cache_shape(num_blocks), dtype, self.device)
        self.raw = self.kv.view(torch.uint8).view(
            spec.num_layers, 2, num_blocks, spec.half_block_bytes
        )
        # per-layer views: (num_blocks, block_size, kv_heads, head_dim), and with slots flattened
        self.k_blocks = [self.kv[i, 0] for i in layers]
        self.v_blocks = [self.kv[i, 1] for i in layers]
        self.k_slots = [self.kv[i, 0].view(-1, heads, dim) for i in layers]
        self.v_slots = [self.kv[i, 1].view(-1, heads, dim) for i in layers]
        if self.paged_kernels:
            self._rows_op = torch.ops.kvwise.paged_decode_attention.default
            # the op can take the step's new rows and write them first (not cast ones)
            self._write_in_op = not self._cast
            self.rows_attention = self._attend_rows

    def write(
        self,
        layer: int,
        slot_mapping: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: int = 0,
    ):
        if self._cast:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k_slots[layer].index_copy_(0, slot_mapping, k)
        self.v_slots[layer].index_copy_(0, slot_mapping, v)

    def gather(
        self, layer: int, block_table: torch.Tensor, first_block: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``PagedKVCache.gather``; with ``first_block`` a float32 pool's result is a view of
        the cache, with no copy."""
        b, nb = block_table.shape
        shape = (b, nb * self.block_size, self.num_kv_heads, self.head_dim)
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

    def _attend_rows(self, layer: int, q, k, v, meta: AttentionMetadata, kind: LayerAttention):
        """Every row through the paged kernel ``(T, num_heads, head_dim)``, as the
        layer's ``kind`` attends (its scale, window, soft cap and sinks)."""
        slots, k, v = meta.writes(k, v)
        if self._write_in_op and not meta.prefills:  # decodes only: write and attend at once
            new = (k, v, slots)
        else:
            self.write(layer, slots, k, v)
            new = ()
        return self._rows_op(
            q,
            self.k_blocks[layer],
            self.v_blocks[layer],
            meta.row_block_table,
            meta.row_ctx_lens,
            kind.scale,
            *new,
            **kind_args(kind),
        )

"""The quantized formats' pool: each block's K (and V) is one run of bytes, its codes then their
scales (``raw`` ``(layers, 2, num_blocks, half_block_bytes)`` uint8), with typed views of both
(``codes[layer][half]``, ``scales[layer][half]``, in the layouts ``KVSpec`` documents); rows are
quantized as they are written and dequantized as they are gathered. ``int8`` is here; ``int4``
(keys sealed per block) in ``int4.py``.
"""

from __future__ import annotations

import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.worker import kv_quant
from kvwise.worker.attention_metadata import AttentionMetadata, LayerAttention
from kvwise.worker.kv_cache.base import PagedKVCache, kind_args, zeroed_pool


class QuantizedKVCache(PagedKVCache):
    """Codes and scales in one byte pool; a subclass says how a half is viewed and read."""

    lossy = True

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        compute_dtype: torch.dtype | None = None,
        use_kernels: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(spec, num_blocks, compute_dtype or torch.float32, use_kernels, device)
        shape = (spec.num_layers, 2, num_blocks, spec.half_block_bytes)
        self.raw = zeroed_pool(shape, torch.uint8, self.device)
        # [layer][0 = K, 1 = V]: typed views of the codes and the scales of every block
        halves = [
            [self._typed_views(self.raw[i, kv], kv) for kv in (0, 1)]
            for i in range(spec.num_layers)
        ]
        self.codes = [[h[0] for h in layer] for layer in halves]
        self.scales = [[h[1] for h in layer] for layer in halves]
        self.k_blocks = [self.raw[i, 0] for i in range(spec.num_layers)]
        self.v_blocks = [self.raw[i, 1] for i in range(spec.num_layers)]

    def _typed_views(self, half: torch.Tensor, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of one layer's K (``kv`` 0) or V (1) block halves, ``half``
        ``(num_blocks, half_block_bytes)`` uint8."""
        raise NotImplementedError

    def _dequantize(self, kv: int, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Blocks of one half back to float32 ``(n, block_size, kv_heads, head_dim)``."""
        raise NotImplementedError

    def gather(
        self, layer: int, block_table: torch.Tensor, first_block: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``PagedKVCache.gather``: dequantized, float32 (always a copy)."""
        b, nb = block_table.shape
        shape = (b, nb * self.block_size, self.num_kv_heads, self.head_dim)
        ids = block_table.reshape(-1)
        out = []
        for kv in (0, 1):
            codes = self.codes[layer][kv].index_select(0, ids)
            scales = self.scales[layer][kv].index_select(0, ids)
            out.append(self._dequantize(kv, codes, scales).reshape(shape))
        return out[0], out[1]


class Int8KVCache(QuantizedKVCache):
    """int8: one float32 scale per token and KV head, both halves. Rows are quantized by the
    C++ op where it is built (the same bytes as ``kv_quant``); the paged int8 kernel reads
    codes and scales in place, and a decode-only step writes and attends in one call."""

    skips_writes = True

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        compute_dtype: torch.dtype | None = None,
        use_kernels: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(spec, num_blocks, compute_dtype, use_kernels, device)
        self._write_op = torch.ops.kvwise.kv_write_int8.default if self.use_kernels else None
        if self.paged_kernels:
            self._rows_op = torch.ops.kvwise.paged_decode_attention_int8.default
            self.rows_attention = self._attend_rows

    def _typed_views(self, half: torch.Tensor, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        cb, bs, heads, dim = spec.codes_bytes, spec.block_size, spec.num_kv_heads, spec.head_dim
        codes = half[:, :cb].view(torch.int8).view(-1, bs, heads, dim)
        return codes, half[:, cb:].view(torch.float32).view(-1, bs, heads)

    def _dequantize(self, kv: int, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return kv_quant.dequantize_int8(codes, scales)

    def write(
        self,
        layer: int,
        slot_mapping: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: int = 0,
    ):
        if self._write_op is not None:
            self._write_op(
                self.k_blocks[layer], self.v_blocks[layer], k, v, slot_mapping, self.block_size
            )
            return
        blocks = slot_mapping // self.block_size
        offsets = slot_mapping % self.block_size
        for kv, x in ((0, k), (1, v)):
            codes, scales = kv_quant.quantize_int8(x.float())
            self.codes[layer][kv][blocks, offsets] = codes
            self.scales[layer][kv][blocks, offsets] = scales

    def _attend_rows(self, layer: int, q, k, v, meta: AttentionMetadata, kind: LayerAttention):
        """Every row through the paged int8 kernel ``(T, num_heads, head_dim)``, as the
        layer's ``kind`` attends (its scale, window, soft cap and sinks)."""
        slots, k, v = meta.writes(k, v)
        if meta.prefills:
            self.write(layer, slots, k, v)
            new = ()
        else:  # decodes only: write and attend at once
            new = (k, v, slots)
        return self._rows_op(
            q,
            self.k_blocks[layer],
            self.v_blocks[layer],
            meta.row_block_table,
            meta.row_ctx_lens,
            kind.scale,
            self.block_size,
            *new,
            **kind_args(kind),
        )

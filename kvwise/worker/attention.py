"""Attention over the paged KV cache: the torch SDPA reference backend (runs on CPU).

The model calls ``attn(layer, q, k, v)`` once per layer with the new tokens of every
scheduled request flattened into one dimension. The backend first writes all new K/V rows into
their slots, then attends:

- decode rows (one new token each) in one call of kvwise's paged decode kernel
  (``csrc/paged_attention.cpp``, ``csrc/kv_int4.cpp``), which reads K/V where they lie in the
  pool (float32, int8 or int4 codes and their scales); without it (no compiler, a 16-bit
  float pool, ``paged_kernel=False``), in one batched SDPA call over their gathered
  (dequantized) blocks, with a padding mask when their context lengths differ;
- each prefill chunk in its own call: a chunk starting at position 0 attends to its own K/V
  with a causal mask; a later chunk attends to its gathered blocks with an offset causal mask.
  When the pool stores K/V lossily (quantized, or a narrower float), every chunk attends to
  its gathered blocks, so that a prompt sees the K/V the cache holds whether it was computed
  now or loaded.

int4 keys are quantized per block once it is full (``kv_cache.py``). A query then attends to
the keys of earlier blocks as their sealed bytes hold them and to its own block's keys in full
precision (``attend_open_blocks``; decodes overlay their own block's staged keys on the
gathered ones). What a token sees depends only on its position, never on how the prompt was
chunked or whether its prefix was cached: the sealed bytes of a block are the same whichever
way it was computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvwise.worker import kernels
from kvwise.worker.kv_cache import PagedKVCache


@dataclass
class PrefillChunk:
    token_start: int  # rows [token_start, token_end) of the flattened batch
    token_end: int
    start_pos: int  # position of the first row in its sequence
    block_table: torch.Tensor  # (1, num_blocks) long
    first_block: int | None = None  # set when the table is consecutive ids from here


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step; built once, used by every layer."""

    slot_mapping: torch.Tensor  # (T,) long
    decode_rows: torch.Tensor | None  # (Bd,) long: rows of the batch that are decodes
    decode_block_table: torch.Tensor | None  # (Bd, max_blocks) long
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, max_blocks * block_size) bool, or None
    decode_ctx_len: int  # longest decode context (keys beyond it are not gathered)
    decode_rows_contiguous: bool  # decode rows are 0..Bd-1
    prefills: list[PrefillChunk]
    decode_first_block: int | None = None  # one decode whose blocks are consecutive ids
    decode_ctx_lens: torch.Tensor | None = None  # (Bd,) long: each decode's context length
    decode_open_blocks: list[int] | None = None  # each decode's own (last) block id
    decode_open_index: torch.Tensor | None = None  # (Bd,) long: its index in the block table


class TorchSDPAAttention:
    """The reference paged-attention backend. Stateless apart from the cache it is given."""

    def __init__(
        self, kv_cache: PagedKVCache, num_heads: int, head_dim: int, paged_kernel: bool = True
    ) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sealed_keys = kv_cache.spec.sealed_keys
        # int4 decodes: a kernel reading codes and scales in place (csrc/kv_int4.cpp)
        self.paged_int4 = paged_kernel and self.sealed_keys and kernels.available()
        self.paged_kernel = (
            paged_kernel and kv_cache.dtype == torch.float32 and not kv_cache._cast
            and kernels.available()
        )  # fmt: skip
        self._decode = (
            torch.ops.kvwise.paged_decode_attention.default if self.paged_kernel else None
        )
        # int8 KV: the same kernel reading int8 codes and their scales in place
        self.paged_int8 = paged_kernel and kv_cache.spec.dtype == "int8" and kernels.available()
        if self.paged_int8:
            self.paged_kernel = True
            int8_op = torch.ops.kvwise.paged_decode_attention_int8.default
            block_size = kv_cache.block_size
            self._decode = lambda q, kc, vc, tables, lens, scale, *new: int8_op(
                q, kc, vc, tables, lens, scale, block_size, *new
            )

    def bind(self, meta: AttentionMetadata, layer_ready: Callable[[int], None] | None = None):
        """Return the ``attn(layer, q, k, v)`` callable for one step.

        ``layer_ready(layer)``, when given, is called before a layer reads the cache: it
        blocks until K/V still being loaded for that layer are in place.
        """

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer_ready is not None:
                layer_ready(layer)
            return self.forward(layer, q, k, v, meta)

        return attn

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k: torch.Tensor,  # (T, kv_heads, head_dim)
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cache = self.kv_cache
        num_tokens = q.shape[0]
        if self.paged_kernel and not meta.prefills and meta.decode_rows_contiguous:
            # a decode-only step: write the new rows and attend in one call
            return self._decode(
                q, cache.k_blocks[layer], cache.v_blocks[layer], meta.decode_block_table,
                meta.decode_ctx_lens, self.scale, k, v, meta.slot_mapping,
            ).view(num_tokens, self.num_heads * self.head_dim)  # fmt: skip
        cache.write(layer, meta.slot_mapping, k, v)
        out = q.new_empty(num_tokens, self.num_heads, self.head_dim)
        if meta.decode_rows is not None:
            if meta.decode_rows_contiguous:
                rows = slice(0, meta.decode_rows.shape[0])
            else:
                rows = meta.decode_rows
            out[rows] = self._attend_decodes(layer, q[rows], meta)  # (Bd, num_heads, head_dim)
        for chunk in meta.prefills:
            out[chunk.token_start : chunk.token_end] = self._attend_prefill(layer, q, k, v, chunk)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _attend_decodes(
        self, layer: int, qd: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The decode rows ``qd`` ``(Bd, num_heads, head_dim)`` over their cached contexts."""
        cache = self.kv_cache
        if self.paged_kernel:
            return self._decode(
                qd, cache.k_blocks[layer], cache.v_blocks[layer], meta.decode_block_table,
                meta.decode_ctx_lens, self.scale,
            )  # fmt: skip
        if self.paged_int4:
            return torch.ops.kvwise.paged_decode_attention_int4.default(
                qd, cache.k_blocks[layer], cache.v_blocks[layer], cache.staged[layer],
                meta.decode_block_table, meta.decode_ctx_lens,
                cache.slots_of(meta.decode_open_blocks), self.scale, cache.block_size,
                cache.spec.group_size,
            )  # fmt: skip
        # (Bd, L, kv_heads, head_dim) each
        kc, vc = cache.gather(layer, meta.decode_block_table, meta.decode_first_block)
        if self.sealed_keys:  # each decode reads its own block's keys in full precision
            bd = kc.shape[0]
            blocks = kc.view(bd, -1, *cache.spec.block_shape)
            own = cache.decode_open_keys(layer, meta.decode_open_blocks)
            blocks[torch.arange(bd), meta.decode_open_index] = own
        ctx = meta.decode_ctx_len
        kc = kc[:, :ctx].transpose(1, 2)  # (Bd, kv_heads, ctx, head_dim)
        vc = vc[:, :ctx].transpose(1, 2)
        mask = None if meta.decode_mask is None else meta.decode_mask[..., :ctx]
        od = F.scaled_dot_product_attention(
            qd.unsqueeze(2), kc, vc, attn_mask=mask, scale=self.scale, enable_gqa=True
        )  # (Bd, num_heads, 1, head_dim)
        return od.squeeze(2)

    def _attend_prefill(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk
    ) -> torch.Tensor:
        """One prefill chunk's rows of the batch, ``(n, num_heads, head_dim)``."""
        s, e = chunk.token_start, chunk.token_end
        # NOTE: the CPU flash kernel is ~1.5x faster on contiguous (1, heads, n, head_dim)
        # inputs than on strided views of the (T, heads, head_dim) rows.
        qp = q[s:e].transpose(0, 1).contiguous().unsqueeze(0)  # (1, num_heads, n, head_dim)
        n = e - s
        if self.sealed_keys:
            cache, bs, start = self.kv_cache, self.kv_cache.block_size, chunk.start_pos
            kc, vc = cache.gather(layer, chunk.block_table, chunk.first_block)
            first_open = start // bs * bs
            open_k = k[s:e].float()
            if start > first_open:  # rows of the first block written by earlier steps
                first_id = int(chunk.block_table[0, start // bs])
                open_k = torch.cat([cache.open_keys(layer, first_id, start - first_open), open_k])
            return attend_open_blocks(qp, kc[0], vc[0], open_k, start, bs, self.scale)
        if chunk.start_pos == 0 and not self.kv_cache.lossy:
            kp = k[s:e].transpose(0, 1).contiguous().unsqueeze(0)  # (1, kv_heads, n, head_dim)
            vp = v[s:e].transpose(0, 1).contiguous().unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            ctx = chunk.start_pos + n
            kc, vc = self.kv_cache.gather(layer, chunk.block_table, chunk.first_block)
            kp = kc[:, :ctx].transpose(1, 2)  # (1, kv_heads, ctx, head_dim)
            vp = vc[:, :ctx].transpose(1, 2)
            q_pos = torch.arange(chunk.start_pos, ctx).unsqueeze(1)  # (n, 1)
            mask = torch.arange(ctx).unsqueeze(0) <= q_pos  # (n, ctx)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        return op.squeeze(0).transpose(0, 1)


def attend_open_blocks(
    qp: torch.Tensor,  # (1, num_heads, n, head_dim): queries at positions start .. start + n - 1
    kc: torch.Tensor,  # (L, kv_heads, head_dim): keys as the sealed blocks hold them, L >= ctx
    vc: torch.Tensor,  # (L, kv_heads, head_dim): values as stored
    open_k: torch.Tensor,  # (ctx - first_open, kv_heads, head_dim): full-precision keys
    start: int,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention where each query sees earlier blocks' keys as sealed and its own
    block's keys in full precision (``open_k`` from ``first_open``, the start of the first
    query's block). One call per block of queries, ``(n, num_heads, head_dim)``."""
    n = qp.shape[2]
    ctx = start + n
    first_open = start // block_size * block_size
    kt = kc[:ctx].transpose(0, 1).contiguous()  # (kv_heads, ctx, head_dim), patched per block
    vt = vc[:ctx].transpose(0, 1).unsqueeze(0)  # (1, kv_heads, ctx, head_dim)
    open_t = open_k.transpose(0, 1)  # (kv_heads, ctx - first_open, head_dim)
    out = qp.new_empty(1, qp.shape[1], n, qp.shape[3])
    for lo in range(first_open, ctx, block_size):
        hi = min(ctx, lo + block_size)
        q_lo = max(start, lo)
        sealed = kt[:, lo:hi].clone()
        kt[:, lo:hi] = open_t[:, lo - first_open : hi - first_open]
        mask = torch.arange(hi).unsqueeze(0) <= torch.arange(q_lo, hi).unsqueeze(1)
        out[:, :, q_lo - start : hi - start] = F.scaled_dot_product_attention(
            qp[:, :, q_lo - start : hi - start], kt[:, :hi].unsqueeze(0), vt[:, :, :hi],
            attn_mask=mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        kt[:, lo:hi] = sealed
    return out.squeeze(0).transpose(0, 1)

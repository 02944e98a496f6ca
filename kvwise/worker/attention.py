"""Attention over the paged KV cache: the torch SDPA reference backend (runs on CPU).

The model calls ``attn(layer, q, k, v)`` once per layer with the new tokens of every
scheduled request flattened into one dimension. The backend first writes all new K/V rows into
their slots, then attends.

Where kvwise's kernels are built (and the compute dtype is float32), EVERY row, decode or
prefill, goes through one call of the paged kernel (``csrc/paged_attention.cpp`` for float32,
bfloat16, float16 and int8 pools, ``csrc/kv_int4.cpp`` for int4), which reads K/V where they
lie in the pool: a prefill row at position p is a query over the p + 1 keys its sequence has
in the pool, as a decode of that token would be. The kernel's reduction order depends on the
row alone (a fixed split of its keys), so a token's attention has the same bits whichever
batch, prefill chunk or step it runs in, and whether it was decoded, prefilled, recomputed
after a preemption or read from a cached prefix: greedy decoding is batch-invariant
(tests/model/test_batch_invariance.py). A decode-only step over a float32 or int8 pool writes
and attends in one call.

Without the kernels (no compiler, ``paged_kernel=False``, a 16-bit compute dtype), the torch
reference: decode rows in one batched SDPA call over their gathered (dequantized) blocks, with a
padding mask when their context lengths differ; each prefill chunk in its own call: a chunk
starting at position 0 attends to its own K/V with a causal mask; a later chunk attends to its
gathered blocks with an offset causal mask. When the pool stores K/V lossily (quantized, or a
narrower float), every chunk attends to its gathered blocks, so that a prompt sees the K/V the
cache holds whether it was computed now or loaded. The same maths, but SDPA's rounding depends
on the batch: this path is not batch-invariant.

int4 keys are quantized per block once it is full (``kv_cache.py``). A query then attends to
the keys of earlier blocks as their sealed bytes hold them and to its own block's keys in full
precision (the kernel reads them from a staging slot: the cache's for decodes, one built from
the chunk's rows for prefill rows; the torch path: ``attend_open_blocks``, and decodes overlay
their own block's staged keys on the gathered ones). What a token sees depends only on its
position, never on how the prompt was chunked or whether its prefix was cached: the sealed
bytes of a block are the same whichever way it was computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvwise import kernels
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
    # every row, decodes then prefill rows (the paged kernels' view of the step):
    row_block_table: torch.Tensor | None = None  # (T, max_blocks) long: its sequence's blocks
    row_ctx_lens: torch.Tensor | None = None  # (T,) long: position + 1, the keys it attends to


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
        usable = paged_kernel and kv_cache.compute_dtype == torch.float32 and kernels.available()
        # int4: a kernel reading codes and scales in place (csrc/kv_int4.cpp), every row
        self.paged_int4 = usable and self.sealed_keys
        # every other pool: one kernel for all rows (csrc/paged_attention.cpp); float32 and
        # int8 pools can also take the step's new rows and write them first (``_write_in_op``)
        self._rows_op = None
        self._write_in_op = False
        if usable and kv_cache.spec.dtype == "int8":
            int8_op = torch.ops.kvwise.paged_decode_attention_int8.default
            block_size = kv_cache.block_size
            self._rows_op = lambda q, kc, vc, tables, lens, scale, *new: int8_op(
                q, kc, vc, tables, lens, scale, block_size, *new
            )
            self._write_in_op = True
        elif usable and not kv_cache.quantized:  # float32, bfloat16 or float16 pools
            self._rows_op = torch.ops.kvwise.paged_decode_attention.default
            self._write_in_op = not kv_cache._cast
        self.paged_kernel = self._rows_op is not None

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
        if self._rows_op is not None:  # every row through the paged kernel
            if self._write_in_op and not meta.prefills:  # decodes only: write and attend at once
                new = (k, v, meta.slot_mapping)
            else:
                cache.write(layer, meta.slot_mapping, k, v)
                new = ()
            return self._rows_op(
                q, cache.k_blocks[layer], cache.v_blocks[layer], meta.row_block_table,
                meta.row_ctx_lens, self.scale, *new,
            ).view(num_tokens, self.num_heads * self.head_dim)  # fmt: skip
        cache.write(layer, meta.slot_mapping, k, v)
        if self.paged_int4:
            return self._attend_int4(layer, q, k, meta).view(num_tokens, -1)
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

    def _attend_int4(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every row over an int4 pool, by the int4 kernel ``(T, num_heads, head_dim)``: the
        decodes read their own block's keys from the cache's staging slots, the prefill rows
        from blocks of full-precision keys built from their chunk's rows."""
        cache = self.kv_cache
        op = torch.ops.kvwise.paged_decode_attention_int4.default
        kc, vc, bs = cache.k_blocks[layer], cache.v_blocks[layer], cache.block_size
        num_decodes = 0 if meta.decode_rows is None else meta.decode_rows.shape[0]
        if not meta.prefills:
            return op(q, kc, vc, cache.staged[layer], meta.row_block_table, meta.row_ctx_lens,
                      cache.slots_of(meta.decode_open_blocks), self.scale, bs,
                      cache.spec.group_size)  # fmt: skip
        out = q.new_empty(q.shape[0], self.num_heads, self.head_dim)
        if num_decodes:
            out[:num_decodes] = op(
                q[:num_decodes], kc, vc, cache.staged[layer], meta.row_block_table[:num_decodes],
                meta.row_ctx_lens[:num_decodes], cache.slots_of(meta.decode_open_blocks),
                self.scale, bs, cache.spec.group_size,
            )  # fmt: skip
        open_keys, open_index = self._prefill_open_keys(layer, k, meta.prefills)
        out[num_decodes:] = op(
            q[num_decodes:], kc, vc, open_keys, meta.row_block_table[num_decodes:],
            meta.row_ctx_lens[num_decodes:], open_index, self.scale, bs, cache.spec.group_size,
        )  # fmt: skip
        return out

    def _prefill_open_keys(
        self, layer: int, k: torch.Tensor, chunks: list[PrefillChunk]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """int4: the full-precision keys of every block the prefill chunks write into
        ``(blocks, block_size, kv_heads, head_dim)`` (rows written by earlier steps from their
        staging slot, then the chunk's rows), and each prefill row's own block in it ``(rows,)``:
        what a decode of that token would read from the cache's staging slot."""
        cache, bs = self.kv_cache, self.kv_cache.block_size
        parts, index, base = [], [], 0
        for chunk in chunks:
            start, n = chunk.start_pos, chunk.token_end - chunk.token_start
            first, last = start // bs, (start + n - 1) // bs
            keys = k.new_zeros((last - first + 1) * bs, *k.shape[1:], dtype=torch.float32)
            before = start - first * bs  # rows of the first block written by earlier steps
            if before:
                first_id = int(chunk.block_table[0, first])
                keys[:before] = cache.open_keys(layer, first_id, before)
            keys[before : before + n] = k[chunk.token_start : chunk.token_end]
            parts.append(keys)
            index.append(torch.arange(start, start + n) // bs - first + base)
            base += last - first + 1
        open_keys = parts[0] if len(parts) == 1 else torch.cat(parts)
        return open_keys.view(-1, bs, *k.shape[1:]), torch.cat(index)

    def _attend_decodes(
        self, layer: int, qd: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The decode rows ``qd`` ``(Bd, num_heads, head_dim)`` over their cached contexts
        (the torch path)."""
        cache = self.kv_cache
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
        """One prefill chunk's rows of the batch, ``(n, num_heads, head_dim)`` (the torch
        path)."""
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


def attend_int4_sequence(
    q: torch.Tensor,  # (T, num_heads, head_dim): one sequence's queries, positions 0 .. T - 1
    k: torch.Tensor,  # (T, kv_heads, head_dim), full precision
    v: torch.Tensor,  # (T, kv_heads, head_dim), full precision
    block_size: int,
    group_size: int = 0,
) -> torch.Tensor:
    """What the engine's attention computes for these rows prefilled as one chunk over an int4
    pool (keys sealed per block, values per token): the same write and the same kernel, so
    ``kvwise eval`` measures the engine's own numbers, not those of another rounding order
    (int4 codes turn any rounding difference upstream into a code flip). ``(T, H * D)``."""
    from kvwise.core.kv_spec import KVSpec  # the worker's own types; no cycle at import

    num_tokens, kv_heads, head_dim = k.shape
    num_blocks = -(-num_tokens // block_size)
    spec = KVSpec(1, kv_heads, head_dim, block_size, "int4", group_size=group_size)
    cache = PagedKVCache(spec, num_blocks, torch.float32)
    table = torch.arange(num_blocks).unsqueeze(0)  # (1, num_blocks)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        decode_rows=None,
        decode_block_table=None,
        decode_mask=None,
        decode_ctx_len=0,
        decode_rows_contiguous=True,
        prefills=[PrefillChunk(0, num_tokens, 0, table, first_block=0)],
        row_block_table=table.expand(num_tokens, num_blocks).contiguous(),
        row_ctx_lens=torch.arange(1, num_tokens + 1),
    )
    cache.begin_step()
    return TorchSDPAAttention(cache, q.shape[1], head_dim).forward(0, q, k, v, meta)

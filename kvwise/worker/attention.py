"""Attention over the paged KV cache: the torch SDPA reference backend (any device).

The model calls ``attn(layer, q, k, v)`` once per layer with the new tokens of every
scheduled request flattened into one dimension. The backend first writes all new K/V rows into
their slots, then attends. ``attention_backend.py`` holds the protocol both backends meet, the
paged kernels' backend and ``make_attention``, which chooses.

Where kvwise's kernels are built (the pool on the CPU, the compute dtype float32), EVERY row,
decode or prefill, goes through one call of its format's paged kernel (the cache's ``rows_attention``:
``csrc/paged_attention.cpp`` for float32, bfloat16, float16 and int8 pools, ``csrc/kv_int4.cpp``
for int4), which reads K/V where they lie in the pool: a prefill row at position p is a query
over the p + 1 keys its sequence has in the pool, as a decode of that token would be. The
kernel's reduction order depends on the row alone (a fixed split of its keys), so a token's
attention has the same bits whichever batch, prefill chunk or step it runs in, and whether it
was decoded, prefilled, recomputed after a preemption or read from a cached prefix: greedy
decoding is batch-invariant (tests/model/test_batch_invariance.py).

Without the kernels (no compiler, ``use_kernels=False`` or ``paged_kernel=False``, a 16-bit
compute dtype, a device other than the CPU), the torch reference (``TorchSDPAAttention``): decode rows in one batched SDPA call over their gathered
(dequantized) blocks, with a padding mask when their context lengths differ; each prefill chunk
in its own call: a chunk starting at position 0 attends to its own K/V with a causal mask; a
later chunk attends to its gathered blocks with an offset causal mask. When the pool stores K/V
lossily (quantized, or a narrower float), every chunk attends to its gathered blocks, so that a
prompt sees the K/V the cache holds whether it was computed now or loaded. The same maths, but
SDPA's rounding depends on the batch: this path is not batch-invariant.

Sliding windows and soft caps: each layer's kind (``LayerAttention``: its window, softmax scale
and score soft cap, from the model's ``attention_kinds``) is the backend's. A row at position p
of a windowed layer attends to keys ``p - W < j <= p``: the paged kernels take the window
(``window=W``: they skip the spans before it, the first one cut where the window starts, so a
row's bits still depend on the row alone), the torch path masks. A soft-capped layer (Gemma 2's
``attn_logit_softcapping``) turns every scaled score s into ``c * tanh(s / c)`` before the
softmax: the paged kernels take ``softcap=c``; SDPA cannot, so the torch path computes that
layer's scores explicitly (``models/layers.softcapped_attention``). A layer with neither calls
the kernels exactly as before; the int4 kernel (``csrc/kv_int4.cpp``) takes both the same way.

A format with sealed keys (int4: ``KVSpec.sealed_keys``) quantizes a block's keys once it is
full. A query then attends to the keys of earlier blocks as their sealed bytes hold them and to
its own block's keys in full precision (the cache keeps them: its ``decode_kv`` for decodes,
``open_block_keys`` for a prefill chunk, which ``attend_open_blocks`` reads). What a token sees
depends only on its position, never on how the prompt was chunked or whether its prefix was
cached: the sealed bytes of a block are the same whichever way it was computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvwise.models.layers import softcapped_attention
from kvwise.worker.attention_metadata import (
    AttentionLayers,
    AttentionMetadata,
    LayerAttention,
    PrefillChunk,
)


class TorchSDPAAttention(AttentionLayers):
    """The reference paged-attention backend, in plain torch: it runs on any device and with
    any format (the kernels' backend is ``attention_backend.PagedKernelAttention``; choose
    with ``attention_backend.make_attention``). Stateless apart from the cache it is given.
    Writes still use the cache's ops where it was built with its kernels. ``bind``: the
    base's, each layer through ``forward``."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k: torch.Tensor,  # (T, kv_heads, head_dim)
        v: torch.Tensor,
        meta: AttentionMetadata,
        kind: LayerAttention | None = None,
    ) -> torch.Tensor:
        """One layer's attention; ``layer`` indexes the cache (a hybrid cache's slot, whose
        ``kind`` is then given)."""
        num_tokens = q.shape[0]
        kind = kind or self.kind(layer)
        self.kv_cache.write(layer, *meta.writes(k, v), group=meta.group)
        out = q.new_empty(num_tokens, self.num_heads, self.head_dim)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._attend_decodes(layer, q[:nd], meta, kind)  # (Bd, heads, head_dim)
        for chunk in meta.prefills:
            rows = self._attend_prefill(layer, q, k, v, chunk, kind)
            out[chunk.token_start : chunk.token_end] = rows
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _attend_decodes(
        self, layer: int, qd: torch.Tensor, meta: AttentionMetadata, kind: LayerAttention
    ) -> torch.Tensor:
        """The decode rows ``qd`` ``(Bd, num_heads, head_dim)`` over their cached contexts
        (the torch path)."""
        kc, vc = self.kv_cache.decode_kv(layer, meta)  # (Bd, L, kv_heads, head_dim) each
        ctx = meta.decode_ctx_len
        kc = kc[:, :ctx].transpose(1, 2)  # (Bd, kv_heads, ctx, head_dim)
        vc = vc[:, :ctx].transpose(1, 2)
        mask = None if meta.decode_mask is None else meta.decode_mask[..., :ctx]
        if kind.window and ctx > kind.window:  # keys j >= len - W, len = the row's context
            lens = meta.row_ctx_lens[: qd.shape[0]].view(-1, 1, 1, 1)
            inside = torch.arange(ctx, device=qd.device) >= lens - kind.window  # (Bd, 1, 1, ctx)
            mask = inside if mask is None else mask & inside
        od = _sdpa(qd.unsqueeze(2), kc, vc, kind, mask)  # (Bd, num_heads, 1, head_dim)
        return od.squeeze(2)

    def _attend_prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunk: PrefillChunk,
        kind: LayerAttention,
    ) -> torch.Tensor:
        """One prefill chunk's rows of the batch, ``(n, num_heads, head_dim)`` (the torch
        path)."""
        cache, s, e = self.kv_cache, chunk.token_start, chunk.token_end
        window = kind.window
        # NOTE: the CPU flash kernel is ~1.5x faster on contiguous (1, heads, n, head_dim)
        # inputs than on strided views of the (T, heads, head_dim) rows.
        qp = q[s:e].transpose(0, 1).contiguous().unsqueeze(0)  # (1, num_heads, n, head_dim)
        if cache.spec.sealed_keys:
            kc, vc = cache.gather(layer, chunk.block_table, chunk.first_block)
            open_k = cache.open_block_keys(layer, chunk, k)
            return attend_open_blocks(
                qp, kc[0], vc[0], open_k, chunk.start_pos, cache.block_size, kind
            )
        if chunk.start_pos == 0 and not cache.lossy and (not window or e - s <= window):
            kp = k[s:e].transpose(0, 1).contiguous().unsqueeze(0)  # (1, kv_heads, n, head_dim)
            vp = v[s:e].transpose(0, 1).contiguous().unsqueeze(0)
            op = _sdpa(qp, kp, vp, kind, is_causal=True)
        else:
            ctx = chunk.start_pos + e - s
            kc, vc = cache.gather(layer, chunk.block_table, chunk.first_block)
            kp = kc[:, :ctx].transpose(1, 2)  # (1, kv_heads, ctx, head_dim)
            vp = vc[:, :ctx].transpose(1, 2)
            q_pos = torch.arange(chunk.start_pos, ctx, device=q.device).unsqueeze(1)  # (n, 1)
            keys = torch.arange(ctx, device=q.device).unsqueeze(0)  # (1, ctx)
            mask = keys <= q_pos  # (n, ctx)
            if window:
                mask &= keys > q_pos - window
            op = _sdpa(qp, kp, vp, kind, mask)
        return op.squeeze(0).transpose(0, 1)


def _sdpa(
    q: torch.Tensor,  # (B, num_heads, n, head_dim)
    k: torch.Tensor,  # (B, kv_heads, L, head_dim)
    v: torch.Tensor,
    kind: LayerAttention,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA at the layer's scale; a soft-capped layer's scores computed explicitly (SDPA
    cannot cap them). ``(B, num_heads, n, head_dim)``."""
    if kind.softcap or kind.sinks is not None:
        return softcapped_attention(
            q, k, v, kind.scale, kind.softcap, mask, is_causal, sinks=kind.sinks
        )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=kind.scale, enable_gqa=True
    )


def attend_open_blocks(
    qp: torch.Tensor,  # (1, num_heads, n, head_dim): queries at positions start .. start + n - 1
    kc: torch.Tensor,  # (L, kv_heads, head_dim): keys as the sealed blocks hold them, L >= ctx
    vc: torch.Tensor,  # (L, kv_heads, head_dim): values as stored
    open_k: torch.Tensor,  # (ctx - first_open, kv_heads, head_dim): full-precision keys
    start: int,
    block_size: int,
    kind: LayerAttention,
) -> torch.Tensor:
    """Causal attention where each query sees earlier blocks' keys as sealed and its own
    block's keys in full precision (``open_k`` from ``first_open``, the start of the first
    query's block), within the layer's window and soft cap. One call per block of queries,
    ``(n, num_heads, head_dim)``."""
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
        keys = torch.arange(hi, device=qp.device).unsqueeze(0)
        q_pos = torch.arange(q_lo, hi, device=qp.device).unsqueeze(1)
        mask = keys <= q_pos
        if kind.window:
            mask &= keys > q_pos - kind.window
        out[:, :, q_lo - start : hi - start] = _sdpa(
            qp[:, :, q_lo - start : hi - start], kt[:, :hi].unsqueeze(0), vt[:, :, :hi], kind, mask
        )
        kt[:, lo:hi] = sealed
    return out.squeeze(0).transpose(0, 1)

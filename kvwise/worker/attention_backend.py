"""The attention backend seam: the protocol the model runner calls, the paged C++ kernels'
backend, and ``make_attention``, which picks one for a pool.

Two backends meet ``AttentionBackend``:

- ``PagedKernelAttention``: every row, decode or prefill, through one call of its format's
  paged kernel (the cache's ``rows_attention``), which writes the step's rows and reads K/V
  where they lie in the pool; its reduction order depends on the row alone, so greedy
  decoding is batch-invariant. There only where the format has a kernel and the cache was
  built with its kernels: the pool on the CPU (the kernels are registered for the CPU
  dispatch key alone), float32 compute.
- ``TorchSDPAAttention`` (``attention.py``): plain torch, any device, any format; the same
  maths with SDPA's batch-dependent rounding.

A device that gets kernels of its own (CUDA) adds a backend here and a branch in
``make_attention``; the model, the runner and the core do not change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvwise.worker.attention import TorchSDPAAttention
from kvwise.worker.attention_metadata import AttentionLayers, AttentionMetadata, LayerAttention

# (layer, q (T, heads, head_dim), k, v (T, kv_heads, head_dim)) -> (T, heads * head_dim)
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class AttentionBackend(Protocol):
    """What the model runner asks of an attention backend."""

    kv_cache: object  # the pool it reads and writes (kv_cache.PagedKVCache)
    num_heads: int
    head_dim: int
    layers: list[LayerAttention] | None  # each layer's kind; None: every layer full
    paged_kernel: bool  # every row through the format's C++ kernel

    def bind(
        self,
        meta: AttentionMetadata,
        layer_ready: Callable[[int], None] | None = None,
        group_metas: list[AttentionMetadata] | None = None,
    ) -> AttnFn:
        """The ``attn(layer, q, k, v)`` the model calls once per layer in one step.

        ``layer_ready(slot)``, when given, is called before a layer reads the cache: it
        blocks until K/V still being loaded for that slot of the pages are in place.
        ``group_metas``: each hybrid KV group's metadata (group 0's is ``meta``)."""
        ...

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kind: LayerAttention | None = None,
    ) -> torch.Tensor:
        """One layer's attention, ``(T, heads * head_dim)``; ``layer`` indexes the cache (a
        hybrid cache's slot, whose ``kind`` is then given)."""
        ...


class PagedKernelAttention(AttentionLayers):
    """Every row through the pool format's paged kernel (see the module docstring): for a
    pool whose ``rows_attention`` is set (``make_attention`` checks)."""

    paged_kernel = True

    def bind(
        self,
        meta: AttentionMetadata,
        layer_ready: Callable[[int], None] | None = None,
        group_metas: list[AttentionMetadata] | None = None,
    ) -> AttnFn:
        """See ``AttentionBackend.bind``."""
        rows, full = self.kv_cache.rows_attention, self._full
        width = self.num_heads * self.head_dim
        if self.places is None and layer_ready is None:
            if self.layers is None:  # the hot path: one kind, one group, nothing loading

                def attn_rows(layer: int, q, k, v) -> torch.Tensor:
                    return rows(layer, q, k, v, meta, full).view(q.shape[0], width)

                return attn_rows
            kinds = self.layers  # each layer its own window and scale

            def attn_kinds(layer: int, q, k, v) -> torch.Tensor:
                return rows(layer, q, k, v, meta, kinds[layer]).view(q.shape[0], width)

            return attn_kinds
        return super().bind(meta, layer_ready, group_metas)  # each layer at its place

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kind: LayerAttention | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``: the kernel writes the rows first."""
        kind = kind or self.kind(layer)
        out = self.kv_cache.rows_attention(layer, q, k, v, meta, kind)
        return out.view(q.shape[0], self.num_heads * self.head_dim)


def make_attention(
    kv_cache,
    num_heads: int,
    head_dim: int,
    layers: list[LayerAttention] | None = None,
    places: list[tuple[int, int]] | None = None,
    paged_kernel: bool = True,
) -> AttentionBackend:
    """The backend for ``kv_cache``: its format's paged kernel where it has one (and
    ``paged_kernel``), else the torch reference."""
    if paged_kernel and kv_cache.rows_attention is not None:
        return PagedKernelAttention(kv_cache, num_heads, head_dim, layers, places)
    return TorchSDPAAttention(kv_cache, num_heads, head_dim, layers, places)

"""Shared by the paged-kernel tests: one step of decodes and prefill chunks through the
attention backend's torch path and through its paged kernel, every layer compared."""

from __future__ import annotations

import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.core.outputs import ScheduledRequest, SchedulerOutput
from kvwise.types import SamplingParams
from kvwise.worker.attention_backend import make_attention
from kvwise.worker.input_batch import build_input_batch
from kvwise.worker.kv_cache import make_kv_cache


def torch_path_against_kernel(layers, kv: str, shapes, heads: int, kv_heads: int, dim: int,
                              block: int, atol: float = 1e-4) -> None:  # fmt: skip
    """``shapes``: each request's (cached tokens, new tokens); the cached prefixes written by
    an earlier step into both pools (``kv`` format, 64 blocks), then each layer of
    ``layers`` (``LayerAttention``) attended both ways, within ``atol`` / rtol 1e-3."""
    spec = KVSpec(len(layers), kv_heads, dim, block, kv)
    gen = torch.Generator().manual_seed(11)
    caches = [make_kv_cache(spec, 64, torch.float32, use) for use in (True, False)]
    first, earlier, scheduled = 0, [], []
    for i, (cached, n) in enumerate(shapes):
        count = -(-(cached + n) // block)
        table = list(range(first, first + count))
        earlier += [b * block + o for b in table for o in range(block)][:cached]
        scheduled.append(ScheduledRequest(f"r{i}", [0] * n, cached, table, True,
                                          SamplingParams(), 0))  # fmt: skip
        first += count
    earlier = torch.tensor(earlier)  # the cached prefixes, written by an earlier step
    old_k = torch.randn(len(earlier), kv_heads, dim, generator=gen)
    old_v = torch.randn(len(earlier), kv_heads, dim, generator=gen)
    meta = build_input_batch(SchedulerOutput(scheduled=scheduled), block).attn_meta
    rows = meta.slot_mapping.numel()
    q = torch.randn(rows, heads, dim, generator=gen) * 3
    k = torch.randn(rows, kv_heads, dim, generator=gen)
    v = torch.randn(rows, kv_heads, dim, generator=gen)
    kernel = make_attention(caches[0], heads, dim, layers=layers)
    torch_path = make_attention(caches[1], heads, dim, paged_kernel=False, layers=layers)
    assert kernel.paged_kernel and not torch_path.paged_kernel
    for cache in caches:
        cache.begin_step([], earlier)
        for layer in range(len(layers)):
            cache.write(layer, earlier, old_k, old_v)
        cache.begin_step([], meta.slot_mapping)
    for layer in range(len(layers)):
        got = torch_path.bind(meta)(layer, q, k, v)
        want = kernel.bind(meta)(layer, q, k, v)
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-3)

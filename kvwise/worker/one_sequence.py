"""The engine's attention for one sequence prefilled cold in one chunk, outside an engine: what
``kvwise eval`` runs to measure a KV format the pool stores.

``sequence_attention(spec, num_heads, num_tokens)`` builds a fresh pool of the format's own
class (``make_kv_cache``), the step's metadata through ``build_input_batch`` (as the scheduler's
``SchedulerOutput`` would give it) and the attention backend, and returns the
``attn(layer, q, k, v)`` the model calls: the same write, the same kernel and so the same bits
as the engine's step over that prompt (int4 codes turn any rounding difference upstream into a
code flip: a measurement through another rounding order measures another format).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.core.outputs import ScheduledRequest, SchedulerOutput
from kvwise.types import SamplingParams
from kvwise.worker.attention_backend import make_attention
from kvwise.worker.attention_metadata import LayerAttention
from kvwise.worker.input_batch import build_input_batch
from kvwise.worker.kv_cache import make_kv_cache


def sequence_attention(
    spec: KVSpec,
    num_heads: int,
    num_tokens: int,
    compute_dtype: torch.dtype = torch.float32,
    use_kernels: bool = True,
    layers: list[LayerAttention] | None = None,
) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``attn(layer, q, k, v) -> (T, num_heads * head_dim)`` for ``num_tokens`` rows at
    positions ``0 .. num_tokens - 1`` of one sequence, each layer of ``spec`` called once;
    ``layers``: each layer's window and scale (``LayerAttention``)."""
    num_blocks = -(-num_tokens // spec.block_size)
    cache = make_kv_cache(spec, num_blocks, compute_dtype, use_kernels)
    request = ScheduledRequest(
        "eval", [0] * num_tokens, 0, list(range(num_blocks)), False, SamplingParams(), 0
    )
    meta = build_input_batch(SchedulerOutput(scheduled=[request]), spec.block_size).attn_meta
    cache.begin_step([], meta.slot_mapping)
    return make_attention(cache, num_heads, spec.head_dim, layers=layers).bind(meta)

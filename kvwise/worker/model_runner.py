"""Runs one step on the model: ``execute(SchedulerOutput) -> ModelOutput``.

``ModelRunner`` owns the model weights, the paged KV tensors and the attention backend.
``FakeModelRunner`` (fake_runner.py, no torch) stands in for it in tests of the layers above.
"""

from __future__ import annotations

import torch

from kvwise.core.outputs import ModelOutput, SchedulerOutput
from kvwise.worker.attention import TorchSDPAAttention
from kvwise.worker.input_batch import build_input_batch
from kvwise.worker.kv_cache import PagedKVCache
from kvwise.worker.sampler import sample


class ModelRunner:
    def __init__(self, model, arch, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.model = model
        self.arch = arch
        self.block_size = block_size
        self.kv_cache = PagedKVCache(
            arch.num_layers, num_blocks, block_size, arch.num_kv_heads, arch.head_dim, dtype
        )
        self.attention = TorchSDPAAttention(self.kv_cache, arch.num_heads, arch.head_dim)
        self.block_bytes = PagedKVCache.bytes_per_block(
            arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, dtype
        )

    @torch.inference_mode()
    def write_kv(
        self, block_ids: list[int], payload, num_entry_blocks: int, skip: int, layers
    ) -> int:
        """Copy one stored layer group into device blocks (any thread). Returns bytes copied."""
        self.kv_cache.write_blocks(block_ids, payload, num_entry_blocks, skip, layers)
        return len(block_ids) * layers[1] * self.block_bytes // self.arch.num_layers

    @torch.inference_mode()
    def save_kv(self, block_ids: list[int]):
        """A host copy of device blocks, as a buffer (a numpy array) for the tiers."""
        return self.kv_cache.read_blocks(block_ids).view(torch.uint8).numpy()

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput, layer_ready=None) -> ModelOutput:
        """Run one step; ``layer_ready(layer)`` (optional) blocks until loads for that layer
        are in the cache."""
        if sched_out.is_empty:
            return ModelOutput()
        batch = build_input_batch(sched_out, self.block_size)
        attn = self.attention.bind(batch.attn_meta, layer_ready)
        hidden = self.model(batch.input_ids, batch.positions, attn)  # (T, hidden)
        if not batch.sample_requests:
            return ModelOutput()
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # (S, vocab)
        reqs = batch.sample_requests
        token_ids, logprobs = sample(
            logits, [r.sampling_params for r in reqs], [r.output_index for r in reqs]
        )
        return ModelOutput(
            sampled={
                r.request_id: (t, lp) for r, t, lp in zip(reqs, token_ids, logprobs, strict=True)
            }
        )

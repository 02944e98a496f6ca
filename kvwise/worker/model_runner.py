"""Runs one step on the model: ``execute(SchedulerOutput) -> ModelOutput``.

``ModelRunner`` owns the model weights, the paged KV tensors and the attention backend.
``FakeModelRunner`` (fake_runner.py, no torch) stands in for it in tests of the layers above;
both implement the runner contract the engine relies on:

- ``execute(sched_out, layer_ready=None) -> ModelOutput``: one step; ``layer_ready(layer)``,
  when given, is called before a layer reads the cache and blocks until loads for it landed;
- ``save_kv(block_ids)``: a host copy of device blocks, laid out like a stored payload;
- ``write_kv(block_ids, payload, num_entry_blocks, skip, layers)``: copy one stored layer
  group into device blocks (any thread); ``payload_views(...)``: buffers to read one into;
- ``spec`` (the ``KVSpec``), ``num_blocks``, ``num_layers`` and ``vocab_size``;
- ``reads_in_place``: ``payload_views`` can be used (the pool is in host memory); else the
  tiers read into host buffers that ``write_kv`` copies over (``worker/device.py``).

The device: the pool and the weights live on ``device`` (the CPU unless the config names
another); the step's tables are built on the host and moved there once, and the logits come
back to the host to sample.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.core.outputs import ModelOutput, SchedulerOutput
from kvwise.worker.attention_backend import make_attention
from kvwise.worker.attention_metadata import LayerAttention
from kvwise.worker.device import HOST, is_host
from kvwise.worker.input_batch import build_input_batch
from kvwise.worker.kv_cache import make_kv_cache
from kvwise.worker.last_rows import LastRows
from kvwise.worker.sampler import bitmask_words, sample, top_logprobs

PROMPT_LOGITS_ROWS = 64  # prompt logprobs: rows of logits computed at a time


class ModelRunner:
    def __init__(
        self,
        model,
        arch,
        spec: KVSpec,
        num_blocks: int,
        compute_dtype: torch.dtype,
        device: torch.device = HOST,
    ):
        self.model = model
        self.device = device
        self.on_host = is_host(device)
        self.reads_in_place = self.on_host
        self.arch = arch
        self.spec = spec
        self.num_layers = arch.num_layers
        self.vocab_size = arch.vocab_size
        self.block_size = spec.block_size
        self.num_blocks = num_blocks
        # the format's class, on the device
        self.kv_cache = make_kv_cache(spec, num_blocks, compute_dtype, device=device)
        places = None
        layers = layer_attention(model, arch)
        if spec.groups:  # a hybrid KV cache: each layer at its group's slot
            places = [(0, 0)] * arch.num_layers
            for g, group in enumerate(spec.groups):
                for slot, layer in enumerate(group.layers):
                    places[layer] = (g, slot)
            default = LayerAttention(0, arch.head_dim**-0.5)
            layers = layers or [default] * arch.num_layers
        self.num_groups = len(spec.groups) or 1
        # a row whose K/V the pool holds can be left unwritten (core/runner.py)
        self.skips_cached_writes = self.kv_cache.skips_writes and self.num_groups == 1
        self.attention = make_attention(
            self.kv_cache, arch.num_heads, arch.head_dim, layers=layers, places=places
        )
        self.last_rows = LastRows()  # whole hits' first tokens (worker/last_rows.py)

    @torch.inference_mode()
    def write_kv(
        self, block_ids: list[int], payload, num_entry_blocks: int, skip: int, layers
    ) -> int:
        """Copy one stored layer group into device blocks (any thread). Returns bytes copied."""
        self.kv_cache.write_blocks(block_ids, payload, num_entry_blocks, skip, layers)
        return len(block_ids) * layers[1] * self.spec.layer_block_bytes

    def payload_views(
        self, block_ids: list[int], skip: int, num_entry_blocks: int, layers: tuple[int, int]
    ) -> list[memoryview]:
        """Buffers that read a stored layer group straight into device blocks."""
        return self.kv_cache.payload_views(block_ids, skip, num_entry_blocks, layers)

    @torch.inference_mode()
    def save_kv(self, block_ids: list[int]):
        """A host copy of device blocks, as a buffer (a numpy array) for the tiers."""
        return self.kv_cache.read_blocks(block_ids).view(torch.uint8).cpu().numpy()

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput, layer_ready=None) -> ModelOutput:
        """Run one step; ``layer_ready(layer)`` (optional) blocks until loads for that layer
        are in the cache."""
        # whole hits whose last row is kept: sampled from it, not run through the model
        kept = []
        for item in sched_out.scheduled:
            row = self.last_rows.get(item.last_row_key) if item.kv_in_pool and item.sample else None
            if row is not None:
                kept.append((item, row))
        if kept:
            done = {id(item) for item, _ in kept}
            sched_out = replace(
                sched_out, scheduled=[s for s in sched_out.scheduled if id(s) not in done]
            )
        out = ModelOutput(last_rows_reused=len(kept))
        if sched_out.is_empty:
            self.kv_cache.begin_step(sched_out.released_block_ids)
            reqs, rows = [], None
        else:
            reqs, rows = self._forward(sched_out, layer_ready, out)
        if kept:  # after the computed rows (a new list and tensor only here)
            reqs = reqs + [item for item, _ in kept]
            kept_rows = torch.stack([row for _, row in kept])
            rows = kept_rows if rows is None else torch.cat([rows, kept_rows])
        if not reqs:
            return out
        bitmask = bitmask_words(reqs, sched_out.token_bitmasks, self.vocab_size)
        if self.on_host:
            logits = self.model.compute_logits(rows, bitmask)  # (S, vocab)
        else:  # sampled on the host
            on_device = None if bitmask is None else bitmask.to(self.device)
            logits = self.model.compute_logits(rows, on_device).cpu()
        histories = [None if r.history is None else (r.history, r.num_prompt_tokens) for r in reqs]
        picked = sample(
            logits,
            [r.sampling_params for r in reqs],
            [r.output_index for r in reqs],
            histories,
            bitmask,
        )
        for i, r in enumerate(reqs):
            if i in picked.errors:
                out.failed[r.request_id] = picked.errors[i]
                continue
            out.sampled[r.request_id] = (picked.token_ids[i], picked.logprobs[i])
            if picked.top[i] is not None:
                out.top_logprobs[r.request_id] = picked.top[i]
        return out

    def _forward(self, sched_out: SchedulerOutput, layer_ready, out: ModelOutput):
        """Run the model over the step's rows: the requests that sample and their rows'
        final hidden states; prompt logprobs into ``out``; prompts' last rows kept."""
        batch = build_input_batch(sched_out, self.block_size, self.num_groups)
        if not self.on_host:
            batch = batch.to(self.device)
        # the releases, then the step's slots (each KV group's): a format with per-step state
        # (int4's staging) plans its writes once for every layer of a group
        metas = batch.group_metas
        slots = [m.slot_mapping for m in metas] if metas else batch.attn_meta.slot_mapping
        self.kv_cache.begin_step(sched_out.released_block_ids, slots)
        attn = self.attention.bind(batch.attn_meta, layer_ready, batch.group_metas)
        hidden = self.model(batch.input_ids, batch.positions, attn)  # (T, hidden)
        if batch.prompt_items:
            out.prompt_logprobs = self._prompt_logprobs(batch.prompt_items, hidden)
        rows = hidden[batch.sample_rows]
        for i, r in enumerate(batch.sample_requests):
            if r.last_row_key is not None:
                self.last_rows.put(r.last_row_key, rows[i])
        return batch.sample_requests, rows

    def _prompt_logprobs(self, items, hidden: torch.Tensor) -> dict:
        """Each item's prompt positions its rows predict: (position, the prompt token's
        logprob, the top k), the logits computed ``PROMPT_LOGITS_ROWS`` rows at a time."""
        found = {}
        for item, first_row in items:
            start, k = item.start_pos, item.sampling_params.prompt_logprobs
            # row i predicts position start + i + 1; the prompt's last row predicts an output
            last = min(start + item.num_tokens, item.num_prompt_tokens - 1)
            rows = []
            for lo in range(start, last, PROMPT_LOGITS_ROWS):
                hi = min(last, lo + PROMPT_LOGITS_ROWS)
                h = hidden[first_row + lo - start : first_row + hi - start]
                logits = self.model.compute_logits(h).float().cpu()  # on the host already: as is
                logprobs = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(item.history[lo + 1 : hi + 1], dtype=torch.long)
                chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
                tops = top_logprobs(logprobs, k) if k else [[]] * (hi - lo)
                rows += [(lo + 1 + i, chosen[i], tops[i]) for i in range(hi - lo)]
            found[item.request_id] = rows
        return found


def layer_attention(model, arch) -> list[LayerAttention] | None:
    """Each layer's window, score scale and score soft cap from the model's
    ``attention_kinds``, and its attention sinks (the layer's ``sinks`` weights); None where
    every layer is full attention at ``head_dim ** -0.5`` with no cap and no sinks (or the
    model declares no kinds)."""
    kinds = getattr(model, "attention_kinds", None)
    sinks = [getattr(layer, "sinks", None) for layer in getattr(model, "layers", ())]
    plain = (None, None, None)
    if not kinds or (
        all((k.sliding_window, k.softmax_scale, k.softcap) == plain for k in kinds)
        and all(s is None for s in sinks)
    ):
        return None
    default = arch.head_dim**-0.5
    return [
        LayerAttention(
            k.sliding_window or 0,
            default if k.softmax_scale is None else k.softmax_scale,
            k.softcap or 0.0,
            sinks[i] if i < len(sinks) else None,
        )
        for i, k in enumerate(kinds)
    ]

"""What attention needs to know about a step and a layer, as plain data: ``AttentionMetadata``
(built once a step by ``input_batch``), its ``PrefillChunk``s, and a layer's
``LayerAttention``. Read by the attention backends (``attention``, ``attention_backend``) and
by the KV cache formats (``kv_cache``), which both import it and not each other.

``to(device)`` moves a step's tables to the device the pool lies on (``worker/device.py``);
they are built on the host."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes: keys within ``window`` of the query (0: all), the
    score ``scale``, the scores' soft cap ``softcap`` (``c * tanh(s / c)``; 0: none) and the
    per-head ``sinks`` logits that join every softmax (gpt-oss; a float32 ``(num_heads,)``
    tensor of the model's, None: none)."""

    window: int
    scale: float
    softcap: float = 0.0
    sinks: torch.Tensor | None = field(default=None, compare=False)


class AttentionLayers:
    """What every attention backend knows of the model's layers: each layer's kind
    (``layers``; None: every layer full, scale ``head_dim ** -0.5``) and, for a hybrid KV
    cache, each layer's (group, slot) (``places``: the layer reads its group's metadata and
    the slot of the group's pages; None: layer i is slot i, one group). ``kv_cache``: the
    pool (``kv_cache.PagedKVCache``)."""

    paged_kernel = False  # every row through the format's C++ kernel

    def __init__(
        self,
        kv_cache,
        num_heads: int,
        head_dim: int,
        layers: list[LayerAttention] | None = None,
        places: list[tuple[int, int]] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.layers = list(layers) if layers is not None else None
        self.places = places
        self._full = LayerAttention(0, self.scale)

    def kind(self, layer: int) -> LayerAttention:
        """Layer ``layer``'s window, scale and soft cap."""
        return self._full if self.layers is None else self.layers[layer]

    def place(self, layer: int) -> tuple[int, int]:
        """Layer ``layer``'s (KV group, slot in the group's pages)."""
        return (0, layer) if self.places is None else self.places[layer]

    def bind(self, meta: AttentionMetadata, layer_ready=None, group_metas=None):
        """``attn(layer, q, k, v)`` for one step (``attention_backend.AttentionBackend``):
        each layer waits for its slot's loads (``layer_ready``), then runs ``forward`` at its
        place with its group's metadata (``group_metas``; one group: ``meta``)."""
        metas = group_metas or [meta]

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            group, slot = self.place(layer)
            if layer_ready is not None:
                layer_ready(slot)
            return self.forward(slot, q, k, v, metas[group], self.kind(layer))

        return attn

    def forward(self, layer: int, q, k, v, meta: AttentionMetadata, kind=None) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class PrefillChunk:
    token_start: int  # rows [token_start, token_end) of the flattened batch
    token_end: int
    start_pos: int  # position of the first row in its sequence
    block_table: torch.Tensor  # (1, num_blocks) long
    first_block: int | None = None  # set when the table is consecutive ids from here

    def to(self, device: torch.device) -> PrefillChunk:
        return replace(self, block_table=self.block_table.to(device))


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step; built once, used by every layer. Rows are the
    decodes first (rows ``0 .. num_decodes - 1``), then each prefill chunk's."""

    slot_mapping: torch.Tensor  # (T,) long
    num_decodes: int
    decode_block_table: torch.Tensor | None  # (Bd, max_blocks) long
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, max_blocks * block_size) bool, or None
    decode_ctx_len: int  # longest decode context (keys beyond it are not gathered)
    prefills: list[PrefillChunk]
    decode_first_block: int | None = None  # one decode whose blocks are consecutive ids
    decode_open_index: torch.Tensor | None = None  # (Bd,) long: its own block's table index
    # every row, decodes then prefill rows (the paged kernels' view of the step):
    row_block_table: torch.Tensor | None = None  # (T, max_blocks) long: its sequence's blocks
    row_ctx_lens: torch.Tensor | None = None  # (T,) long: position + 1, the keys it attends to
    group: int = 0  # a hybrid KV cache's group these tables are of
    # the rows whose K/V is written (None: all of them); the others' K/V is in the pool
    # already (``ScheduledRequest.kv_in_pool``)
    write_rows: torch.Tensor | None = None

    def writes(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(slots, k, v)`` of the rows to write."""
        if self.write_rows is None:
            return self.slot_mapping, k, v
        rows = self.write_rows
        return self.slot_mapping[rows], k[rows], v[rows]

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same tables on ``device`` (a copy of each tensor)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, prefills=[c.to(device) for c in self.prefills], **moved)

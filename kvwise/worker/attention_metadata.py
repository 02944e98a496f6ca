"""What attention needs to know about a step and a layer, as plain data: ``AttentionMetadata``
(built once a step by ``input_batch``), its ``PrefillChunk``s, and a layer's
``LayerAttention``. Read by the attention (``attention``) and by the KV cache formats
(``kv_cache``), which both import it and not each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes: keys within ``window`` of the query (0: all), the
    score ``scale`` and the scores' soft cap ``softcap`` (``c * tanh(s / c)``; 0: none)."""

    window: int
    scale: float
    softcap: float = 0.0


@dataclass
class PrefillChunk:
    token_start: int  # rows [token_start, token_end) of the flattened batch
    token_end: int
    start_pos: int  # position of the first row in its sequence
    block_table: torch.Tensor  # (1, num_blocks) long
    first_block: int | None = None  # set when the table is consecutive ids from here


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

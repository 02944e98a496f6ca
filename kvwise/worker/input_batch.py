"""SchedulerOutput → tensors for one forward pass.

Rows are ordered decodes first (one row each, so they are rows ``0 .. Bd-1``), then each
prefill chunk's rows; every row also gets its sequence's block table and its context length
(``row_block_table``, ``row_ctx_lens``: the paged kernels take each row as one query).
``sample_rows`` holds, for every request that samples this step, the row whose logits it
samples from (its last row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwise.core.outputs import ScheduledRequest, SchedulerOutput
from kvwise.worker.attention import AttentionMetadata, PrefillChunk
from kvwise.worker.kv_cache import first_if_consecutive


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long
    attn_meta: AttentionMetadata
    sample_rows: torch.Tensor  # (S,) long
    sample_requests: list[ScheduledRequest]


def build_input_batch(sched_out: SchedulerOutput, block_size: int) -> InputBatch:
    decodes = [s for s in sched_out.scheduled if s.num_tokens == 1]
    prefills = [s for s in sched_out.scheduled if s.num_tokens > 1]
    ordered = decodes + prefills

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_requests: list[ScheduledRequest] = []
    chunks: list[PrefillChunk] = []
    for item in ordered:
        row = len(input_ids)
        n = item.num_tokens
        input_ids.extend(item.token_ids)
        pos = range(item.start_pos, item.start_pos + n)
        positions.extend(pos)
        table = item.block_ids
        slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        if n > 1:
            num_blocks = -(-(item.start_pos + n) // block_size)
            chunks.append(
                PrefillChunk(
                    token_start=row,
                    token_end=row + n,
                    start_pos=item.start_pos,
                    block_table=torch.tensor([table[:num_blocks]], dtype=torch.long),
                    first_block=first_if_consecutive(table[:num_blocks]),
                )
            )
        if item.sample:
            sample_rows.append(row + n - 1)
            sample_requests.append(item)

    decode_rows = decode_table = decode_mask = decode_lens = open_index = None
    open_blocks = None
    decode_ctx_len = 0
    if decodes:
        ctx_lens = [d.start_pos + 1 for d in decodes]
        decode_ctx_len = max(ctx_lens)
        max_blocks = -(-decode_ctx_len // block_size)
        decode_rows = torch.arange(len(decodes))
        decode_lens = torch.tensor(ctx_lens, dtype=torch.long)
        open_index = torch.tensor([d.start_pos // block_size for d in decodes], dtype=torch.long)
        open_blocks = [d.block_ids[d.start_pos // block_size] for d in decodes]
        decode_table = torch.tensor(
            [
                d.block_ids[:max_blocks] + [0] * (max_blocks - len(d.block_ids[:max_blocks]))
                for d in decodes
            ],
            dtype=torch.long,
        )  # (Bd, max_blocks); padding points at block 0 and is masked out
        if min(ctx_lens) != decode_ctx_len:
            lens = torch.tensor(ctx_lens).unsqueeze(1)  # (Bd, 1)
            mask = torch.arange(max_blocks * block_size).unsqueeze(0) < lens
            decode_mask = mask[:, None, None, :]  # (Bd, 1, 1, L)

    row_table, row_lens = _row_tables(ordered, decode_table, positions, block_size)
    decode_first_block = None
    if len(decodes) == 1:
        decode_first_block = first_if_consecutive(decodes[0].block_ids[: len(decode_table[0])])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        decode_rows=decode_rows,
        decode_block_table=decode_table,
        decode_mask=decode_mask,
        decode_ctx_len=decode_ctx_len,
        decode_rows_contiguous=True,
        prefills=chunks,
        decode_first_block=decode_first_block,
        decode_ctx_lens=decode_lens,
        decode_open_blocks=open_blocks,
        decode_open_index=open_index,
        row_block_table=row_table,
        row_ctx_lens=row_lens,
    )
    return InputBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        attn_meta=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long),
        sample_requests=sample_requests,
    )


def _row_tables(
    ordered: list[ScheduledRequest],
    decode_table: torch.Tensor | None,
    positions: list[int],
    block_size: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each row's block table ``(T, max_blocks)`` (its sequence's, zero-padded) and context
    length ``(T,)`` (its position + 1): every row, decode or prefill, as one query of the paged
    kernels."""
    if not ordered:
        return None, None
    row_lens = torch.tensor(positions, dtype=torch.long) + 1
    if len(ordered) == (0 if decode_table is None else decode_table.shape[0]):
        return decode_table, row_lens  # decodes only: their table is already one row each
    needed = [-(-(s.start_pos + s.num_tokens) // block_size) for s in ordered]
    width = max(needed)
    tables = torch.tensor(
        [s.block_ids[:n] + [0] * (width - n) for s, n in zip(ordered, needed, strict=True)],
        dtype=torch.long,
    )  # (S, width); padding points at block 0 and is never read
    counts = torch.tensor([s.num_tokens for s in ordered])
    return tables.repeat_interleave(counts, dim=0), row_lens

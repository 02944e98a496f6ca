"""SchedulerOutput → tensors for one forward pass.

Rows are ordered decodes first (one row each, so they are rows ``0 .. Bd-1``), then each
prefill chunk's rows; every row also gets its sequence's block table and its context length
(``row_block_table``, ``row_ctx_lens``: the paged kernels take each row as one query).
``sample_rows`` holds, for every request that samples this step, the row whose logits it
samples from (its last row). A hybrid KV cache's groups each have their own block tables, so
their own ``AttentionMetadata`` over the same rows (``group_metas``; group 0's is
``attn_meta``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvwise.core.outputs import ScheduledRequest, SchedulerOutput
from kvwise.worker.attention_metadata import AttentionMetadata, PrefillChunk
from kvwise.worker.kv_cache import first_if_consecutive


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long
    attn_meta: AttentionMetadata
    sample_rows: torch.Tensor  # (S,) long
    sample_requests: list[ScheduledRequest]
    group_metas: list[AttentionMetadata] | None = None  # each KV group's (0: attn_meta)
    # requests asking for prompt logprobs: (item, the row of its first token)
    prompt_items: list[tuple[ScheduledRequest, int]] | None = None

    def to(self, device: torch.device) -> InputBatch:
        """The batch's tensors on ``device`` (the pool's, where it is not the host)."""
        metas = None if self.group_metas is None else [m.to(device) for m in self.group_metas]
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            attn_meta=metas[0] if metas else self.attn_meta.to(device),
            sample_rows=self.sample_rows.to(device),
            group_metas=metas,
        )


@dataclass
class _Rows:
    """The step's rows as Python lists, in order."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    sample_rows: list[int]
    sample_requests: list[ScheduledRequest]
    chunks: list[PrefillChunk]
    prompt_items: list[tuple[ScheduledRequest, int]] = field(default_factory=list)
    in_pool: list[int] = field(default_factory=list)  # rows whose K/V is not written


def build_input_batch(
    sched_out: SchedulerOutput, block_size: int, num_groups: int = 1
) -> InputBatch:
    decodes = [s for s in sched_out.scheduled if s.num_tokens == 1]
    prefills = [s for s in sched_out.scheduled if s.num_tokens > 1]
    rows = _flatten(decodes + prefills, block_size)
    meta = _metadata(decodes, prefills, rows, block_size)
    metas = None
    if num_groups > 1:
        metas = [meta]
        for g in range(num_groups - 1):
            d, p = (
                [replace(s, block_ids=s.group_block_ids[g]) for s in part]
                for part in (decodes, prefills)
            )
            metas.append(
                replace(_metadata(d, p, _flatten(d + p, block_size), block_size), group=g + 1)
            )
    return InputBatch(
        input_ids=torch.tensor(rows.input_ids, dtype=torch.long),
        positions=torch.tensor(rows.positions, dtype=torch.long),
        attn_meta=meta,
        sample_rows=torch.tensor(rows.sample_rows, dtype=torch.long),
        sample_requests=rows.sample_requests,
        group_metas=metas,
        prompt_items=rows.prompt_items or None,
    )


def _metadata(
    decodes: list[ScheduledRequest],
    prefills: list[ScheduledRequest],
    rows: _Rows,
    block_size: int,
) -> AttentionMetadata:
    """The step's attention metadata over the block tables the items carry."""
    ordered = decodes + prefills
    decode_table = decode_mask = open_index = decode_first_block = None
    decode_ctx_len = 0
    if decodes:
        decode_table, decode_mask, open_index, decode_ctx_len = _decode_tables(decodes, block_size)
        if len(decodes) == 1:
            decode_first_block = first_if_consecutive(decodes[0].block_ids[: len(decode_table[0])])
    row_table, row_lens = _row_tables(ordered, decode_table, rows.positions, block_size)
    write_rows = None
    if rows.in_pool:
        skipped = set(rows.in_pool)
        kept = [r for r in range(len(rows.slots)) if r not in skipped]
        write_rows = torch.tensor(kept, dtype=torch.long)
    return AttentionMetadata(
        slot_mapping=torch.tensor(rows.slots, dtype=torch.long),
        num_decodes=len(decodes),
        decode_block_table=decode_table,
        decode_mask=decode_mask,
        decode_ctx_len=decode_ctx_len,
        prefills=rows.chunks,
        decode_first_block=decode_first_block,
        decode_open_index=open_index,
        row_block_table=row_table,
        row_ctx_lens=row_lens,
        write_rows=write_rows,
    )


def _flatten(ordered: list[ScheduledRequest], block_size: int) -> _Rows:
    """Each request's rows: token ids, positions, slots; its prefill chunk; its sample row."""
    rows = _Rows([], [], [], [], [], [])
    for item in ordered:
        row = len(rows.input_ids)
        n = item.num_tokens
        rows.input_ids.extend(item.token_ids)
        pos = range(item.start_pos, item.start_pos + n)
        rows.positions.extend(pos)
        table = item.block_ids
        rows.slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        rows.in_pool.extend(range(row, row + item.kv_in_pool))
        if n > 1:
            num_blocks = -(-(item.start_pos + n) // block_size)
            rows.chunks.append(
                PrefillChunk(
                    token_start=row,
                    token_end=row + n,
                    start_pos=item.start_pos,
                    block_table=torch.tensor([table[:num_blocks]], dtype=torch.long),
                    first_block=first_if_consecutive(table[:num_blocks]),
                )
            )
        if item.sampling_params.prompt_logprobs is not None:
            rows.prompt_items.append((item, row))
        if item.sample:
            rows.sample_rows.append(row + n - 1)
            rows.sample_requests.append(item)
    return rows


def _decode_tables(
    decodes: list[ScheduledRequest], block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
    """The decodes' block tables ``(Bd, max_blocks)`` (padding points at block 0 and is masked
    out), their padding mask ``(Bd, 1, 1, L)`` (None when their contexts are equally long),
    each one's own block's index in its table ``(Bd,)`` and the longest context."""
    ctx_lens = [d.start_pos + 1 for d in decodes]
    decode_ctx_len = max(ctx_lens)
    max_blocks = -(-decode_ctx_len // block_size)
    open_index = torch.tensor([d.start_pos // block_size for d in decodes], dtype=torch.long)
    table = torch.tensor(
        [
            d.block_ids[:max_blocks] + [0] * (max_blocks - len(d.block_ids[:max_blocks]))
            for d in decodes
        ],
        dtype=torch.long,
    )
    mask = None
    if min(ctx_lens) != decode_ctx_len:
        lens = torch.tensor(ctx_lens).unsqueeze(1)  # (Bd, 1)
        mask = (torch.arange(max_blocks * block_size).unsqueeze(0) < lens)[:, None, None, :]
    return table, mask, open_index, decode_ctx_len


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

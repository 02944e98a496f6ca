"""The int4 pool: keys quantized per channel over the whole block, values per token in groups of
channels (``KVSpec`` documents the bytes).

A block's keys are written when it is full ("sealed"). Until then its rows wait in ``staged``
``(layers, slots, block_size, kv_heads, head_dim)``, full precision, one slot per open block;
which block has which slot is ``staging`` (``StagingSlots``, plain Python). ``begin_step``
releases slots and plans the step's writes once (``_StepPlan``: the same places for every
layer); attention reads a query's own block's keys from its slot. A sealed block's slot lives
until the next step (that step's attention still reads it); a slot is released when the core
frees its block or reused when its block's first row is written again.

With the kernels, the values and the staged keys are written by one C++ op (the same bytes as
``kv_quant``), and every row attends through ``csrc/kv_int4.cpp``: a decode reads its own
block's keys from the cache's staging slot, a prefill row from blocks of full-precision keys
built from its chunk's rows, so a token sees the same keys decoded or prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.worker import kv_quant
from kvwise.worker.attention_metadata import AttentionMetadata, LayerAttention
from kvwise.worker.kv_cache.quantized import QuantizedKVCache
from kvwise.worker.kv_cache.staging import StagingSlots

INITIAL_SLOTS = 8


@dataclass(frozen=True)
class _StepPlan:
    """A ``StagePlan`` as tensors, for every layer of one step; None: none of that kind."""

    num_rows: int
    stage_index: torch.Tensor  # (T,) each row's flat staging place, -1 where it has none
    row_slots: torch.Tensor  # (T,) each row's own block's staging slot (decodes: always one)
    direct_rows: torch.Tensor | None  # rows of blocks written whole, block by block
    stage_rows: torch.Tensor | None  # rows going to staging slots...
    stage_dst: torch.Tensor | None  # ...at these flat (slot * block_size + offset) places
    seal_slots: torch.Tensor | None  # slots of staged blocks this step completes
    seal_blocks: torch.Tensor | None  # blocks sealed: the direct ones, then the staged ones


def _tensor(values: list[int]) -> torch.Tensor | None:
    return torch.tensor(values, dtype=torch.long) if values else None


class Int4KVCache(QuantizedKVCache):
    host_only = True  # its step plans and staging are host tensors

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        compute_dtype: torch.dtype | None = None,
        use_kernels: bool = True,
    ) -> None:
        super().__init__(spec, num_blocks, compute_dtype, use_kernels)
        self.staging = StagingSlots(spec.block_size, INITIAL_SLOTS)
        # zeros: rows a decode has not reached are masked, but must be finite (NaN * 0 is NaN)
        self.staged = torch.zeros(spec.num_layers, INITIAL_SLOTS, *spec.block_shape)
        self._plans: list[_StepPlan] = []  # this step's, one per KV group
        # values and staging written by a C++ op where it is built (the same bytes)
        self._write_op = torch.ops.kvwise.kv_write_int4.default if self.use_kernels else None
        if self.paged_kernels:
            self._rows_op = torch.ops.kvwise.paged_decode_attention_int4.default
            self.rows_attention = self._attend_rows

    def _typed_views(self, half: torch.Tensor, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        cb, bs, heads, dim = spec.codes_bytes, spec.block_size, spec.num_kv_heads, spec.head_dim
        if kv == 0:  # keys: per channel over the block
            scales = half[:, cb : cb + spec.key_scale_bytes].view(torch.float16)
            return half[:, :cb].view(-1, heads, dim, bs // 2), scales.view(-1, heads, dim, 2)
        # values: per token, in groups of channels
        scales = half[:, cb : cb + spec.value_scale_bytes].view(torch.float16)
        groups = dim // spec.group_size
        return half[:, :cb].view(-1, bs, heads, dim // 2), scales.view(-1, bs, heads, groups, 2)

    def _dequantize(self, kv: int, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if kv == 0:
            return kv_quant.dequantize_int4_keys(codes, scales)
        return kv_quant.dequantize_int4(codes, scales, self.spec.group_size)

    # ---- the step's plan ---------------------------------------------------------------

    def begin_step(
        self,
        released_block_ids: list[int] = (),
        slot_mapping: torch.Tensor | list[torch.Tensor] | None = None,
    ) -> None:
        """Free the staging slots of blocks sealed in the last step and of open blocks the core
        has freed since (``StagingSlots.release``), then plan where this step's rows at
        ``slot_mapping`` go (a hybrid cache: one plan per KV group, over its own blocks, which
        no other group holds): every ``write`` of the step follows its group's plan."""
        self.staging.release(released_block_ids)
        mappings = [slot_mapping] if isinstance(slot_mapping, torch.Tensor) else slot_mapping
        self._plans = [self._make_plan(m.tolist()) for m in mappings or ()]

    def _make_plan(self, slots: list[int]) -> _StepPlan:
        plan = self.staging.plan(slots)
        if self.staging.num_slots > self.staged.shape[1]:  # the staging area grew: so do we
            old = self.staged
            self.staged = torch.zeros(old.shape[0], self.staging.num_slots, *old.shape[2:])
            self.staged[:, : old.shape[1]] = old
        return _StepPlan(
            num_rows=len(slots),
            stage_index=torch.tensor(plan.stage_index, dtype=torch.long),
            row_slots=torch.tensor(plan.row_slots, dtype=torch.long),
            direct_rows=_tensor(plan.direct_rows),
            stage_rows=_tensor(plan.stage_rows),
            stage_dst=_tensor(plan.stage_dst),
            seal_slots=_tensor(plan.seal_slots),
            seal_blocks=_tensor(plan.seal_blocks),
        )

    def _step_plan(self, num_rows: int, group: int = 0) -> _StepPlan:
        plan = self._plans[group] if group < len(self._plans) else None
        if plan is None or plan.num_rows != num_rows:
            raise RuntimeError(
                f"int4 KV: {num_rows} rows written to KV group {group}, but begin_step planned "
                f"{0 if plan is None else plan.num_rows} (call begin_step(released, slot_mapping) "
                f"before a step's writes)"
            )
        return plan

    # ---- writes ------------------------------------------------------------------------

    def write(
        self,
        layer: int,
        slot_mapping: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: int = 0,
    ):
        """Values quantized per token now; keys staged, and those of blocks the step fills
        sealed (``slot_mapping``: KV group ``group``'s for the step, as given to
        ``begin_step``)."""
        plan = self._step_plan(k.shape[0], group)
        k = k.float()
        staged = self.staged[layer]  # (slots, block_size, kv_heads, head_dim)
        if self._write_op is not None:  # values and staging in one C++ call, same bytes
            self._write_op(
                self.v_blocks[layer],
                staged,
                k,
                v,
                slot_mapping,
                plan.stage_index,
                self.block_size,
                self.spec.group_size,
            )
        else:
            blocks = slot_mapping // self.block_size
            offsets = slot_mapping % self.block_size
            codes, scales = kv_quant.quantize_int4(v.float(), self.spec.group_size)
            self.codes[layer][1][blocks, offsets] = codes
            self.scales[layer][1][blocks, offsets] = scales
            if plan.stage_rows is not None:
                staged.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                    0, plan.stage_dst, k.index_select(0, plan.stage_rows)
                )
        parts = []
        if plan.direct_rows is not None:  # blocks written whole in this step
            parts.append(k.index_select(0, plan.direct_rows).view(-1, *self.spec.block_shape))
        if plan.seal_slots is not None:  # blocks completed from their staged rows
            parts.append(staged.index_select(0, plan.seal_slots))
        if parts:
            full = parts[0] if len(parts) == 1 else torch.cat(parts)
            codes, scales = kv_quant.quantize_int4_keys(full)
            self.codes[layer][0][plan.seal_blocks] = codes
            self.scales[layer][0][plan.seal_blocks] = scales

    # ---- the open blocks' keys ----------------------------------------------------------

    def open_keys(self, layer: int, block_id: int, rows: int) -> torch.Tensor:
        """The first ``rows`` staged (full-precision) keys of an open block ``(rows, kv_heads,
        head_dim)``."""
        return self.staged[layer, self.staging.slot_of(block_id), :rows]

    def decode_kv(self, layer: int, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: the decodes' gathered blocks, each decode's own block's keys from
        its staging slot (rows past a decode's position are stale: attention masks them)."""
        kc, vc = self.gather(layer, meta.decode_block_table, meta.decode_first_block)
        bd = kc.shape[0]
        blocks = kc.view(bd, -1, *self.spec.block_shape)
        own = self.staged[layer].index_select(0, self._plans[meta.group].row_slots[:bd])
        blocks[torch.arange(bd), meta.decode_open_index] = own
        return kc, vc

    def open_block_keys(self, layer: int, chunk, k: torch.Tensor) -> torch.Tensor:
        """The torch path: a prefill chunk's keys in full precision from the start of its first
        block (rows written by earlier steps from the block's staging slot)."""
        start, bs = chunk.start_pos, self.block_size
        first_open = start // bs * bs
        open_k = k[chunk.token_start : chunk.token_end].float()
        if start > first_open:
            first_id = int(chunk.block_table[0, start // bs])
            open_k = torch.cat([self.open_keys(layer, first_id, start - first_open), open_k])
        return open_k

    # ---- the kernel path ---------------------------------------------------------------

    def _attend_rows(self, layer: int, q, k, v, meta: AttentionMetadata, kind: LayerAttention):
        """Every row through the int4 kernel ``(T, num_heads, head_dim)``: the decodes read
        their own block's keys from the staging slots, the prefill rows from blocks of
        full-precision keys built from their chunk's rows; ``kind``: the layer's scale, window,
        soft cap and sinks."""
        self.write(layer, meta.slot_mapping, k, v, group=meta.group)
        plan, kc, vc = self._plans[meta.group], self.k_blocks[layer], self.v_blocks[layer]

        def attend(rows: slice, open_keys, open_slots):
            """The kernel over ``rows``, whose open blocks' keys are ``open_keys``."""
            return self._rows_op(
                q[rows],
                kc,
                vc,
                open_keys,
                meta.row_block_table[rows],
                meta.row_ctx_lens[rows],
                open_slots,
                kind.scale,
                self.block_size,
                self.spec.group_size,
                kind.window,
                kind.softcap,
                kind.sinks,
            )

        if not meta.prefills:
            return attend(slice(None), self.staged[layer], plan.row_slots)
        nd = meta.num_decodes
        out = q.new_empty(q.shape[0], q.shape[1], q.shape[2])
        if nd:
            out[:nd] = attend(slice(None, nd), self.staged[layer], plan.row_slots[:nd])
        open_keys, open_index = self._prefill_open_keys(layer, k, meta.prefills)
        out[nd:] = attend(slice(nd, None), open_keys, open_index)
        return out

    def _prefill_open_keys(self, layer: int, k: torch.Tensor, chunks) -> tuple:
        """The full-precision keys of every block the prefill chunks write into ``(blocks,
        block_size, kv_heads, head_dim)`` (rows written by earlier steps from their staging
        slot, then the chunk's rows), and each prefill row's own block in it ``(rows,)``: what
        a decode of that token would read from the cache's staging slot."""
        bs = self.block_size
        parts, index, base = [], [], 0
        for chunk in chunks:
            start, n = chunk.start_pos, chunk.token_end - chunk.token_start
            first, last = start // bs, (start + n - 1) // bs
            keys = k.new_zeros((last - first + 1) * bs, *k.shape[1:], dtype=torch.float32)
            before = start - first * bs  # rows of the first block written by earlier steps
            if before:
                first_id = int(chunk.block_table[0, first])
                keys[:before] = self.open_keys(layer, first_id, before)
            keys[before : before + n] = k[chunk.token_start : chunk.token_end]
            parts.append(keys)
            index.append(torch.arange(start, start + n) // bs - first + base)
            base += last - first + 1
        open_keys = parts[0] if len(parts) == 1 else torch.cat(parts)
        return open_keys.view(-1, bs, *k.shape[1:]), torch.cat(index)

"""``PagedKVCache``: what every KV format's pool offers the attention backend, the model runner
and the tiers. One subclass per format (``floats.py``, ``int8.py``, ``int4.py``), chosen once at
build by ``make_kv_cache`` (``__init__.py``).

The contract:

- ``raw``: the pool as bytes ``(num_layers, 2, num_blocks, half_block_bytes)`` uint8, in the
  order the tiers store it; ``k_blocks[layer]`` / ``v_blocks[layer]``: each layer's K and V
  blocks as the format's kernels take them. ``read_blocks`` / ``write_blocks`` /
  ``payload_views`` move ``raw``'s bytes (here, the same for every format).
- ``begin_step(released_block_ids, slot_mapping)``: once before each step (``slot_mapping``
  ``(T,)``: the step's rows' slots, or a hybrid cache's list of them, one per KV group; None
  for a step with no rows); ``write(layer, slot_mapping, k, v, group)`` then stores each
  layer's new rows (``(T, kv_heads, head_dim)``) at those slots (``group``: the layer's KV
  group, whose slots they are), and ``gather(layer, block_table)`` reads blocks back in the
  compute dtype.
- ``rows_attention``: where the format has a paged kernel (and ``use_kernels``, float32
  compute), ``rows_attention(layer, q, k, v, meta, kind) -> (T, num_heads, head_dim)`` writes
  the step's rows and attends every row over the pool in one go (``kind``: the layer's
  ``LayerAttention``: scale, sliding window, score soft cap, sinks); else None,
  and the torch path reads ``decode_kv`` / ``gather`` (and ``open_block_keys`` for sealed keys).
- ``skips_writes``: the format can leave a row unwritten (``AttentionMetadata.writes``: a
  whole-prompt hit's last row, whose K/V the pool holds); a format that keeps per-step state
  over the step's slots (int4's staging) cannot.
- ``lossy``: storing loses something (quantized, or a narrower float than the compute dtype),
  so prefill attends over what the pool holds and cold and cached prompts see the same K/V.
- ``device``: where the pool lies (``worker/device.py``). kvwise's kernels are registered for
  the CPU only, so on another device the format runs its plain-torch paths; ``host_only``
  formats (int4: its staging plans are host tensors) refuse another device.
  ``payload_views`` needs a pool in host memory (the tiers read into it in place); elsewhere
  the tiers' reads land in host buffers that ``write_blocks`` copies over.
"""

from __future__ import annotations

import math
import mmap
import warnings
from collections.abc import Callable

import torch

from kvwise import kernels
from kvwise.core.kv_spec import KVSpec
from kvwise.worker.attention_metadata import AttentionMetadata, LayerAttention, PrefillChunk

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (layer, q, k, v, meta, kind: LayerAttention) -> (T, num_heads, head_dim)
RowsAttention = Callable[..., torch.Tensor]


def kind_args(kind: LayerAttention) -> dict:
    """The paged kernels' ``window``, ``softcap`` and ``sinks`` arguments of a layer's kind,
    each passed only where the layer has one (a layer without any calls the kernel as before
    they existed)."""
    args: dict = {"window": kind.window} if kind.window else {}
    if kind.softcap:
        args["softcap"] = float(kind.softcap)
    if kind.sinks is not None:
        args["sinks"] = kind.sinks
    return args


class PagedKVCache:
    """The paged KV pool of one format; block ``b`` of the core's pool is ``[:, :, b]``, slot
    ``s`` is block ``s // block_size``, offset ``s % block_size``."""

    lossy: bool = False
    skips_writes: bool = False
    host_only: bool = False
    rows_attention: RowsAttention | None = None
    raw: torch.Tensor
    k_blocks: list[torch.Tensor]
    v_blocks: list[torch.Tensor]

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        compute_dtype: torch.dtype,
        use_kernels: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        self.device = torch.device(device or "cpu")
        if self.host_only and self.device.type != "cpu":
            raise ValueError(
                f"kv_cache_dtype: {spec.dtype} runs on the CPU only, not on {self.device}"
            )
        self.spec = spec
        self.num_layers = spec.num_layers
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.compute_dtype = compute_dtype
        # NOTE: the kernels are the CPU's (TORCH_LIBRARY_IMPL(kvwise, CPU))
        self.use_kernels = use_kernels and self.device.type == "cpu" and kernels.available()
        # the paged attention kernels compute in float32
        self.paged_kernels = self.use_kernels and compute_dtype == torch.float32

    @property
    def num_bytes(self) -> int:
        return self.raw.numel()

    def begin_step(
        self,
        released_block_ids: list[int] = (),
        slot_mapping: torch.Tensor | list[torch.Tensor] | None = None,
    ) -> None:
        """Before a step: blocks the core freed since the last one, and the slots the step's
        rows will be written to (a hybrid cache: each KV group's). Nothing to do for a format
        without per-step state."""

    def write(
        self,
        layer: int,
        slot_mapping: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: int = 0,
    ):
        """Store new K/V rows ``(T, kv_heads, head_dim)`` at their slots ``(T,)`` (of KV group
        ``group``)."""
        raise NotImplementedError

    def gather(
        self, layer: int, block_table: torch.Tensor, first_block: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the blocks in ``block_table`` ``(B, max_blocks)`` as
        ``(B, max_blocks * block_size, kv_heads, head_dim)`` each, in the compute dtype
        (``first_block``: the table is one row of consecutive ids starting there)."""
        raise NotImplementedError

    def decode_kv(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: K/V of each decode's blocks ``(Bd, L, kv_heads, head_dim)``."""
        return self.gather(layer, meta.decode_block_table, meta.decode_first_block)

    def open_block_keys(
        self, layer: int, chunk: PrefillChunk, k: torch.Tensor
    ) -> torch.Tensor | None:
        """Sealed-key formats (the torch path): a prefill chunk's keys in full precision from
        the start of its first block; None for the others."""
        return None

    # ---- block copies for the slower tiers ----------------------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of blocks as bytes ``(layers, 2, len(block_ids), half_block_bytes)``."""
        first = first_if_consecutive(block_ids)
        if first is not None:
            return self.raw[:, :, first : first + len(block_ids)].contiguous()
        ids = torch.tensor(block_ids, device=self.device)
        return self.raw[:, :, ids]  # advanced indexing copies

    def write_blocks(
        self,
        block_ids: list[int],
        payload,
        num_entry_blocks: int,
        skip: int,
        layers: tuple[int, int],
    ) -> None:
        """Copy blocks ``skip .. skip + len(block_ids)`` of a stored payload into ``block_ids``.

        ``payload`` is a buffer laid out ``(num_layers, 2, num_entry_blocks, half_block_bytes)``
        for the ``num_layers`` layers starting at ``layers[0]``.
        """
        first_layer, num_layers = layers
        with warnings.catch_warnings():  # read-only buffers are fine: we only read them
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(payload, dtype=torch.uint8)
        shape = (num_layers, 2, num_entry_blocks, self.spec.half_block_bytes)
        src = src.view(shape)[:, :, skip : skip + len(block_ids)]
        dst = self.raw[first_layer : first_layer + num_layers]
        if dst.device != src.device:  # host staging: the payload crosses to the device once
            src = src.to(dst.device)
        first = first_if_consecutive(block_ids)
        if first is not None:
            dst[:, :, first : first + len(block_ids)].copy_(src)
        else:
            dst[:, :, torch.tensor(block_ids, device=dst.device)] = src

    def payload_views(
        self, block_ids: list[int], skip: int, num_entry_blocks: int, layers: tuple[int, int]
    ) -> list[memoryview]:
        """Writable buffers, in a stored payload's byte order, that put the entry's blocks
        ``skip .. skip + len(block_ids)`` straight into ``block_ids`` (the entry's other
        blocks land in a scratch buffer). For reading an entry with no intermediate copy.
        """
        if self.device.type != "cpu":
            raise ValueError(f"payload_views: the pool is on {self.device}, not in host memory")
        first_layer, num_layers = layers
        tail = num_entry_blocks - skip - len(block_ids)
        block_bytes = self.spec.half_block_bytes
        scratch = memoryview(bytearray((skip + max(tail, 0)) * block_bytes * 2 * num_layers))
        runs = _runs(block_ids)
        raw = self.raw
        views, used = [], 0
        for layer in range(first_layer, first_layer + num_layers):
            for kv in (0, 1):
                if skip:
                    views.append(scratch[used : used + skip * block_bytes])
                    used += skip * block_bytes
                for first, count in runs:
                    views.append(
                        memoryview(raw[layer, kv, first : first + count].numpy()).cast("B")
                    )
                if tail > 0:
                    views.append(scratch[used : used + tail * block_bytes])
                    used += tail * block_bytes
        return views


def zeroed_pool(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """A zero tensor of ``shape`` whose pages the kernel maps on first touch (an anonymous
    private ``mmap``): the pool takes no time to allocate and no RAM for blocks never used,
    and reads as zeros wherever nothing was written, as ``torch.zeros`` would (a gathered
    block's unwritten slots meet masked scores: zeros, never NaN, keep them out of the
    result). ``torch.zeros`` of the whole pool spent ~1 s a GiB writing zeros at start.
    On a ``device`` other than the CPU: that device's zeros."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if device is not None and device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # NOTE: the tensor keeps the mmap alive (frombuffer holds a reference to it)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def _runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """``(first id, count)`` of each run of consecutive ids, in order."""
    runs, j, n = [], 0, len(block_ids)
    while j < n:
        k = j
        while k + 1 < n and block_ids[k + 1] == block_ids[k] + 1:
            k += 1
        runs.append((block_ids[j], k - j + 1))
        j = k + 1
    return runs


def first_if_consecutive(block_ids: list[int]) -> int | None:
    """The first id when ``block_ids`` are consecutive ascending ids (the cache can then be
    sliced instead of gathered), else None."""
    if block_ids and block_ids[-1] - block_ids[0] == len(block_ids) - 1:
        if all(b == block_ids[0] + i for i, b in enumerate(block_ids)):
            return block_ids[0]
    return None

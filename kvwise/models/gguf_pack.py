"""A GGUF tensor's raw blocks -> its kernel's packed layout in one C++ pass (``gguf_pack``).

``fast_pack`` returns, bit for bit, the ``packed`` tensor of the weight ``gguf_load.build_weight``
builds with numpy and torch, without their intermediate arrays (codes, scales, minimums):

- Q4_0, Q4_1: ``Int4Weight.packed`` (``q4_groups``; Q4_0's minimum is float16(-8 d), as there);
- Q8_0: ``Q8Weight.packed`` (``q8_groups``);
- Q5_0, Q5_1, Q2_K .. Q6_K: ``BlockWeight.packed`` (``gguf_blocks.decode`` + ``pack``).

The raw data is only read, so a read-only view of the memory-mapped file serves as it is (a
row-strided view too; anything else is copied once, as the Python path would). It returns None
where the kernels are unavailable or the type has none of these layouts: the caller then takes
the Python path. Only a linear weight's layout: an embedding / LM head in Q4_0 / Q4_1 runs as
int8 blocks (``gguf_load.runs_as``), which this does not make.
"""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import torch

from kvwise import kernels

PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")


def fast_pack(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> torch.Tensor | None:
    """The packed layout of a `(out, in)` tensor's raw GGUF blocks (rows in output order).

    Args:
        raw: the tensor's bytes, `(out, row bytes)` (any dtype viewed as bytes, or flat).
        gguf_type: the tensor's GGUF type name, e.g. ``"Q4_K"``.
        shape: `(out, in)` in weights.

    Returns:
        uint8 `(ceil(out / 8), blocks, bytes)` as the weight's class packs it, or None.
    """
    if gguf_type not in PACKED_TYPES or not kernels.available():
        return None
    rows, cols = shape
    block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]]
    if cols % block:
        raise ValueError(f"weights: a {gguf_type} row of {cols} is not whole blocks of {block}")
    data = _byte_rows(np.asarray(raw), rows, cols // block * type_bytes)
    with warnings.catch_warnings():  # a read-only map: the op only reads it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(data)
    return torch.ops.kvwise.gguf_pack(tensor, gguf_type, rows, cols)


def _byte_rows(data: np.ndarray, rows: int, row_bytes: int) -> np.ndarray:
    """`data` as `(rows, row_bytes)` uint8 whose rows are contiguous: a view where it can be."""
    if data.dtype != np.uint8:
        data = np.ascontiguousarray(data).view(np.uint8)
    if data.size != rows * row_bytes:
        raise ValueError(
            f"weights: {data.size} bytes of raw data for {rows} rows of {row_bytes} bytes"
        )
    if data.ndim != 2 or data.shape != (rows, row_bytes):
        data = np.ascontiguousarray(data).reshape(rows, row_bytes)
    if data.strides[1] != 1 or data.strides[0] < row_bytes:
        data = np.ascontiguousarray(data)
    return data

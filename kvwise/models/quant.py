"""Quantized linear weights, and GGUF blocks mapped onto them.

Three formats, each a weight `[out, in]` applied as `x @ W.T`:

- ``Int4Weight``: 4-bit codes in blocks of 32 input channels, each block with a float16 scale
  `d` and minimum `m`, `w = q * d + m` (GGUF's Q4_1), run by kvwise's int4 x int8 kernel
  (``torch.ops.kvwise.q4mm``, ``kernels/csrc/fused.cpp``): the activations are quantized to
  int8 per block of 32 (`x ~ dx * qx`) and the block sums are exact integer dot products, as in
  llama.cpp. Each row's result is the same whatever the other rows of the batch.
- ``Int8Weight``: int8 codes with one bfloat16 scale per output channel, `w = q * scale`, run
  by `torch._weight_int8pack_mm`, which is vectorised only for bfloat16 activations (with
  float32 inputs it falls back to a scalar loop): `mm` feeds it bfloat16 and returns its
  bfloat16 output; the caller keeps the residual stream in float32.
- ``Q8Weight`` (the embedding and LM head): int8 codes in blocks of 32 with a float16 scale,
  `w = q * d` (GGUF's Q8_0), run like ``Int4Weight`` by ``torch.ops.kvwise.q8mm``.

GGUF blocks map onto them as follows (per block of 32 weights):

- Q4_1 (`x = q * d + m`, q in 0..15, d and m float16): exactly an int4 block (native).
- Q4_0 (`x = (q - 8) * d`): an int4 block with `m = -8 d` (native; exact in float16).
- Every other type of a linear weight (Q8_0, K-quants, ...) is dequantized and requantized to
  int8 per output channel (converted).
- The embedding / LM head: requantized to Q8Weight, which gives Q8_0 blocks back exactly
  (native for Q8_0; converted otherwise).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvwise import kernels

QK = 32  # weights per GGUF Q4_0 / Q4_1 / Q8_0 block, and per int4 block here


class Int4Weight:
    """A linear weight in 4-bit blocks for kvwise's int4 kernel (see the module docstring).

    Args:
        codes: `(out, in)` integer codes in 0..15.
        scales, mins: `(out, in // 32)` float, `w = q * scale + min` (held as float16).

    Packed as ``kernels/csrc/fused.cpp`` reads it: `(out / 8, in / 32, 160)` bytes (the output
    padded to a multiple of 8 with zero columns).
    """

    group_size = QK

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
        out_features, in_features = codes.shape
        if in_features % QK or scales.shape != (out_features, in_features // QK):
            raise ValueError(
                f"weights: int4 codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                f"do not make blocks of {QK} input channels"
            )
        if mins.shape != scales.shape:
            raise ValueError(
                f"weights: int4 mins {tuple(mins.shape)} != scales {tuple(scales.shape)}"
            )
        self.out_features, self.in_features = out_features, in_features
        codes = _by_column_groups(codes.to(torch.uint8))  # (G, B, column, k)
        groups, blocks = codes.shape[:2]
        # chunk j, byte 4 * column + t: k = 4 j + t in the low nibble, 16 + 4 j + t in the high
        lo = codes[..., :16].reshape(groups, blocks, 8, 4, 4).permute(0, 1, 3, 2, 4)
        hi = codes[..., 16:].reshape(groups, blocks, 8, 4, 4).permute(0, 1, 3, 2, 4)
        code_bytes = (lo | (hi << 4)).reshape(groups, blocks, 128)
        halves = (_float16_bytes(t) for t in (scales, mins))
        self.packed = torch.cat((code_bytes, *halves), dim=-1).contiguous()

    @classmethod
    def from_packed(cls, packed: torch.Tensor, out_features: int, in_features: int) -> Int4Weight:
        """A weight of packed groups made already (``models/gguf_pack.py``)."""
        weight = cls.__new__(cls)
        weight.packed, weight.out_features, weight.in_features = packed, out_features, in_features
        return weight

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        """Asymmetric min/max quantization of a float `(out, in)` weight, blocks of 32."""
        out_features, in_features = weight.shape
        if in_features % QK:
            raise ValueError(
                f"weights: int4 needs a multiple of {QK} input channels, got {in_features}"
            )
        blocks = weight.float().reshape(out_features, in_features // QK, QK)
        low, high = blocks.amin(-1), blocks.amax(-1)
        low16 = low.to(torch.float16).float()  # choose the codes for the float16 d and m
        scale = ((high - low16) / 15).clamp(min=1e-12).to(torch.float16).float()
        codes = torch.round((blocks - low16[..., None]) / scale[..., None]).clamp(0, 15)
        return cls(codes.reshape(out_features, in_features), scale, low16)

    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes `(out, in)` float, d and m `(out, in // 32)` float32, as the kernel holds them."""
        groups, blocks, _ = self.packed.shape
        code_bytes = self.packed[..., :128].reshape(groups, blocks, 4, 8, 4)  # (G, B, j, c, t)
        c = torch.cat((code_bytes & 15, code_bytes >> 4), dim=2)  # (G, B, 8, c, t): k = 4 j + t
        c = c.permute(0, 3, 1, 2, 4).reshape(groups * 8, blocks * QK)
        n = self.out_features
        return c[:n].float(), _float16s(self.packed, 128)[:n], _float16s(self.packed, 144)[:n]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(T, in)` (any float dtype) -> `(T, out)` float32."""
        x = x.float().contiguous()
        if kernels.available():
            return torch.ops.kvwise.q4mm(x, self.packed)[:, : self.out_features]
        return quantize_activations(x) @ self.dequantize().t()  # the same up to float rounding

    def dequantize(self) -> torch.Tensor:
        """The float32 `(out, in)` weight the kernel computes with."""
        codes, d, m = self._unpacked()
        blocks = codes.reshape(self.out_features, -1, QK)
        return (blocks * d[..., None] + m[..., None]).reshape(self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


def _by_column_groups(codes: torch.Tensor) -> torch.Tensor:
    """`(out, in)` codes -> `(out / 8, in / 32, 8, 32)`: groups of 8 output columns by blocks of
    32 inputs (the output padded with zero columns to a multiple of 8)."""
    codes = F.pad(codes, (0, 0, 0, -codes.shape[0] % 8))
    groups, blocks = codes.shape[0] // 8, codes.shape[1] // QK
    return codes.reshape(groups, 8, blocks, QK).permute(0, 2, 1, 3)


def _float16_bytes(t: torch.Tensor) -> torch.Tensor:
    """Per-block `(out, in / 32)` floats -> `(out / 8, in / 32, 16)` bytes: a group's 8 float16s."""
    t = F.pad(t.float(), (0, 0, 0, -t.shape[0] % 8))
    groups, blocks = t.shape[0] // 8, t.shape[1]
    t = t.reshape(groups, 8, blocks).permute(0, 2, 1).to(torch.float16).contiguous()
    return t.view(torch.uint8).reshape(groups, blocks, 16)


def _float16s(packed: torch.Tensor, offset: int) -> torch.Tensor:
    """The inverse of ``_float16_bytes`` for the 16 bytes at ``offset`` of each packed block."""
    groups, blocks, _ = packed.shape
    t = packed[..., offset : offset + 16].contiguous().view(torch.float16)  # (G, B, 8)
    return t.float().permute(0, 2, 1).reshape(groups * 8, blocks)


class Q8Weight:
    """A weight in int8 blocks of 32 input channels, each with a float16 scale: `w = q * d`
    (GGUF's Q8_0; the embedding and LM head). Run by ``torch.ops.kvwise.q8mm`` with the
    activations quantized as for ``Int4Weight``; `rows` gives exact float32 rows.

    Packed as ``kernels/csrc/fused.cpp`` reads it: `(out / 8, in / 32, 272)` bytes.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        out_features, in_features = codes.shape
        if in_features % QK or scales.shape != (out_features, in_features // QK):
            raise ValueError(
                f"weights: int8 codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                f"do not make blocks of {QK} input channels"
            )
        self.out_features, self.in_features = out_features, in_features
        grouped = _by_column_groups(codes.to(torch.int8))  # (G, B, column, k)
        groups, blocks = grouped.shape[:2]
        # chunk j, byte 4 * column + t: k = 4 j + t
        code_bytes = grouped.reshape(groups, blocks, 8, 8, 4).permute(0, 1, 3, 2, 4)
        code_bytes = code_bytes.contiguous().view(torch.uint8).reshape(groups, blocks, 256)
        self.packed = torch.cat((code_bytes, _float16_bytes(scales)), dim=-1).contiguous()

    @classmethod
    def from_packed(cls, packed: torch.Tensor, out_features: int, in_features: int) -> Q8Weight:
        """A weight of packed groups made already (e.g. slices' ``packed``, end to end)."""
        weight = cls.__new__(cls)
        weight.packed, weight.out_features, weight.in_features = packed, out_features, in_features
        return weight

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q8Weight:
        """Symmetric quantization per block of 32 (`d = max|w| / 127`, held as float16), as
        llama.cpp makes Q8_0: a weight dequantized from Q8_0 quantizes back to the same blocks."""
        out_features, in_features = weight.shape
        if in_features % QK:
            raise ValueError(
                f"weights: int8 blocks need a multiple of {QK} input channels, got {in_features}"
            )
        blocks = weight.float().reshape(out_features, in_features // QK, QK)
        scale = (blocks.abs().amax(-1) / 127).to(torch.float16).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(blocks / safe[..., None]).clamp(-127, 127)
        return cls(codes.reshape(out_features, in_features), scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of the weight as float32 `(*ids.shape, in)`, exact (an
        embedding lookup)."""
        groups, blocks, _ = self.packed.shape
        flat = ids.reshape(-1)
        group, column = flat // 8, flat % 8
        picked = self.packed[group]  # (n, B, 272): the rows' groups only
        codes = picked[..., :256].view(torch.int8).reshape(len(flat), blocks, 8, 8, 4)
        codes = codes[torch.arange(len(flat)), :, :, column, :].float()  # (n, B, j, t)
        scales = picked[..., 256:].contiguous().view(torch.float16)  # (n, B, 8)
        d = scales[torch.arange(len(flat)), :, column].float()  # (n, B)
        rows = codes.reshape(len(flat), blocks, QK) * d[..., None]
        return rows.reshape(*ids.shape, self.in_features)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(T, in)` (any float dtype) -> `(T, out)` float32."""
        x = x.float().contiguous()
        if kernels.available():
            return torch.ops.kvwise.q8mm(x, self.packed)[:, : self.out_features]
        return quantize_activations(x) @ self.dequantize().t()  # the same up to float rounding

    def dot_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`x` `(N, in)` float, `ids` `(N, k)` -> `(N, k)` float32: x[n] . row ids[n][i], in
        float32 from the exact rows (refines a few of ``mm``'s outputs)."""
        x = x.float().contiguous()
        if kernels.available():
            return torch.ops.kvwise.q8_rows_dot(x, self.packed, ids.contiguous())
        return torch.einsum("nkh,nh->nk", self.rows(ids), x)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """`x` `(T, K)` float32 rounded as the int4 kernel rounds it: to int8 per block of 32
    (`dx = max|x| / 127`), returned dequantized (`dx * qx`)."""
    blocks = x.float().reshape(x.shape[0], -1, QK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127)).reshape(x.shape)


class Int8Weight:
    """A linear weight as int8 with one scale per output channel (see the module docstring)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        if codes.shape[1] % 16:  # torch's kernel reads 16 at a time: others crash the process
            raise ValueError(
                f"quantization: int8 weights need an input width that is a multiple of 16, "
                f"got a {codes.shape[0]}x{codes.shape[1]} weight"
            )
        self.codes = codes.to(torch.int8).contiguous()  # (out, in)
        self.scales = scales.to(torch.bfloat16).contiguous()  # (out,)
        self.out_features, self.in_features = self.codes.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric per-output-channel quantization of a float `(out, in)` weight; the scale
        is rounded to bfloat16 first, so the codes are chosen for the scale the kernel uses."""
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16).float()
        codes = torch.round(weight / scales[:, None]).clamp(-127, 127)
        return cls(codes, scales)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(T, in)` (any float dtype) -> `(T, out)` bfloat16."""
        return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.codes, self.scales)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None].float()

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


QuantWeight = Int4Weight | Int8Weight


# ---- GGUF blocks ------------------------------------------------------------------------------


def q4_groups(raw: np.ndarray, kind: str, shape: tuple[int, int]):
    """Codes `(out, in)` uint8 in 0..15 and float32 scales and minimums `(out, in // 32)` of a
    Q4_0 or Q4_1 tensor's raw blocks, such that `w = q * scale + min`."""
    out_features, in_features = shape
    block_bytes = 18 if kind == "Q4_0" else 20
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    if kind == "Q4_0":
        m = -8 * d  # exact: a power of two times a float16
        qs = blocks[:, 2:18]
    else:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        qs = blocks[:, 4:20]
    # a block's byte j holds weight j in its low nibble and weight j + 16 in its high one
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=1)  # (blocks, 32)
    groups = in_features // QK
    return (
        torch.from_numpy(codes.reshape(out_features, in_features)),
        torch.from_numpy(d.reshape(out_features, groups)),
        torch.from_numpy(m.reshape(out_features, groups)),
    )

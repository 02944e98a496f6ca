"""Quantized linear weights for torch's CPU kernels, and GGUF blocks mapped onto them.

Two formats, each a weight `[out, in]` applied as `x @ W.T`:

- ``Int4Weight``: 4-bit codes in groups of `group_size` input channels, each group with a
  bfloat16 scale and zero, `w = (q - 8) * scale + zero`, run by
  `torch.ops.aten._weight_int4pack_mm_for_cpu`.
- ``Int8Weight``: int8 codes with one bfloat16 scale per output channel, `w = q * scale`, run
  by `torch._weight_int8pack_mm`.

Both kernels are vectorised only for bfloat16 activations (with float32 inputs they fall back
to a scalar loop), so `mm` takes the float32 activations, feeds the kernel bfloat16 and returns
its bfloat16 output; the caller keeps the residual stream in float32.

GGUF blocks map onto them as follows (per block of 32 weights):

- Q4_1 (`x = q * d + m`, q in 0..15): exactly an int4 group with `scale = d`,
  `zero = m + 8 * d`, except that the kernel holds scale and zero in bfloat16 (native).
- Q4_0 (`x = (q - 8) * d`): an int4 group with `scale = d`, `zero = 0` (native).
- Every other type of a linear weight (Q8_0, K-quants, ...) is dequantized and requantized to
  int8 per output channel (converted).
"""

from __future__ import annotations

import numpy as np
import torch

QK = 32  # weights per GGUF Q4_0 / Q4_1 / Q8_0 block
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INNER_K_TILES = 2


class Int4Weight:
    """A linear weight in 4-bit groups for the CPU int4 kernel (see the module docstring).

    Args:
        codes: `(out, in)` integer codes in 0..15.
        scales, zeros: `(out, in // group_size)` float, `w = (q - 8) * scale + zero`.
    """

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
    ) -> None:
        out_features, in_features = codes.shape
        if in_features % group_size or scales.shape != (out_features, in_features // group_size):
            raise ValueError(
                f"weights: int4 codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                f"do not match group size {group_size}"
            )
        self.out_features, self.in_features, self.group_size = out_features, in_features, group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), _INNER_K_TILES
        )
        # (in // group, out, 2): the kernel's layout
        self.scales_zeros = torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16)
        self.scales_zeros = self.scales_zeros.contiguous()

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = QK) -> Int4Weight:
        """Asymmetric min/max quantization of a float `(out, in)` weight."""
        out_features, in_features = weight.shape
        groups = weight.float().reshape(out_features, in_features // group_size, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        return cls(codes.reshape(out_features, in_features), scale, low + 8 * scale, group_size)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(T, in)` (any float dtype) -> `(T, out)` bfloat16."""
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            x = x.to(torch.bfloat16).contiguous()
        return _INT4_MM(x, self.packed, self.group_size, self.scales_zeros)

    def dequantize(self) -> torch.Tensor:
        """The float32 `(out, in)` weight the kernel computes with."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self.mm(eye).float().t().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


class Int8Weight:
    """A linear weight as int8 with one scale per output channel (see the module docstring)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
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

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized to float32 (an embedding lookup)."""
        return self.codes[ids].float() * self.scales[ids, None].float()

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None].float()

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


QuantWeight = Int4Weight | Int8Weight


# ---- GGUF blocks ------------------------------------------------------------------------------


def q4_groups(raw: np.ndarray, kind: str, shape: tuple[int, int]):
    """Codes `(out, in)` uint8 in 0..15 and float32 scales and zeros `(out, in // 32)` of a
    Q4_0 or Q4_1 tensor's raw blocks, such that `w = (q - 8) * scale + zero`."""
    out_features, in_features = shape
    block_bytes = 18 if kind == "Q4_0" else 20
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    if kind == "Q4_0":
        zero = np.zeros_like(d)
        qs = blocks[:, 2:18]
    else:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        zero = m + 8 * d
        qs = blocks[:, 4:20]
    # a block's byte j holds weight j in its low nibble and weight j + 16 in its high one
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=1)  # (blocks, 32)
    groups = in_features // QK
    return (
        torch.from_numpy(codes.reshape(out_features, in_features)),
        torch.from_numpy(d.reshape(out_features, groups)),
        torch.from_numpy(zero.reshape(out_features, groups)),
    )

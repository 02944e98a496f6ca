"""Quantized KV formats (``KVSpec`` documents them): quantize K/V rows as they are written into
the pool, dequantize them as attention reads them. Plain torch; kvwise's C++ kernels
(``csrc/kv_quant.cpp``) implement the same arithmetic, operation for operation, so a row
quantized by either has the same bytes.

- ``int8``: ``scale = amax * (1/127)`` per token and KV head (float32), ``q = round(x / scale)``
  computed as ``round(x * (127 / amax))``; ``x ≈ q * scale``. An all-zero row has scale 0.
- ``int4``: per token, KV head and group of ``group`` channels: ``min``, ``scale = (max - min)
  / 15``, both rounded to float16 first, then ``q = clamp(round((x - min) * (1 / scale)), 0,
  15)``; ``x ≈ q * scale + min``. Two codes a byte: channel ``2i`` in the low nibble, ``2i+1``
  in the high one.
"""

from __future__ import annotations

import torch

INV_127 = 1.0 / 127.0
_F16_MAX = 65504.0  # int4's scale and minimum are float16: K/V beyond this saturate


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(..., D)`` float32 -> codes ``(..., D)`` int8, scales ``(...)`` float32."""
    amax = x.abs().amax(dim=-1)  # (...)
    scale = amax * INV_127
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(x * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.unsqueeze(-1)


def quantize_int4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(..., D)`` float32 -> packed codes ``(..., D // 2)`` uint8 and ``(..., D //
    group, 2)`` float16 (scale, min)."""
    *lead, dim = x.shape
    g = x.reshape(*lead, dim // group, group)
    low = g.amin(dim=-1).clamp(-_F16_MAX, _F16_MAX).half()
    scale = ((g.amax(dim=-1) - low.float()) * (1.0 / 15.0)).clamp(max=_F16_MAX).half()
    s32 = scale.float()
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    q = torch.round((g - low.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15)
    q = q.to(torch.uint8).reshape(*lead, dim // 2, 2)
    packed = q[..., 0] | (q[..., 1] << 4)
    return packed, torch.stack((scale, low), dim=-1)


def dequantize_int4(packed: torch.Tensor, scale_min: torch.Tensor, group: int) -> torch.Tensor:
    *lead, half = packed.shape
    q = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*lead, half * 2 // group, group)
    sm = scale_min.float()
    return (q.float() * sm[..., 0:1] + sm[..., 1:2]).reshape(*lead, half * 2)


def quantize(x: torch.Tensor, dtype: str, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of ``x`` float32 in the quantized format ``dtype`` (int8 or int4)."""
    return quantize_int8(x) if dtype == "int8" else quantize_int4(x, group)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: str, group: int = 0):
    """``quantize``'s inverse, float32."""
    if dtype == "int8":
        return dequantize_int8(codes, scales)
    return dequantize_int4(codes, scales, group)


ROUND_TRIP_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4", "int4-kc")
KC_BLOCK = 16  # "int4-kc": tokens per key block (the pool's block size)


def round_trip(
    x: torch.Tensor, dtype: str, group: int = 0, keys: bool = False, kc_block: int = KC_BLOCK
) -> torch.Tensor:
    """``x`` ``(T, heads, D)`` float32 as a pool of ``dtype`` hands it back to attention
    (stored, then read): what ``kvwise eval`` feeds its attention to measure a KV format.

    ``"int4-kc"`` is measured only, not stored by the pool: KIVI's layout, keys (``keys``)
    quantized per channel over each block of ``kc_block`` tokens (4-bit, a float16 scale and
    minimum per block, head and channel; the last, partial block kept in float32, as a pool
    that quantizes a block when it is sealed would), values as ``int4``."""
    if dtype == "int4-kc":
        if not keys:
            return round_trip(x, "int4", group)
        if kc_block < 2 or kc_block % 2:
            raise ValueError(f"kv_kc_block: expected an even number of tokens, got {kc_block}")
        full = x.shape[0] // kc_block * kc_block
        if full == 0:
            return x
        blocks = x[:full].reshape(full // kc_block, kc_block, *x.shape[1:])
        per_channel = blocks.movedim(1, -1)  # (blocks, heads, D, kc_block): a group per channel
        back = dequantize_int4(*quantize_int4(per_channel, kc_block), kc_block)
        return torch.cat([back.movedim(-1, 1).reshape(full, *x.shape[1:]), x[full:]])
    if dtype == "float32":
        return x
    if dtype in ("bfloat16", "float16"):
        return x.to(getattr(torch, dtype)).float()
    if dtype in ("int8", "int4"):
        group = group or min(32, x.shape[-1])
        return dequantize(*quantize(x, dtype, group), dtype, group)
    raise ValueError(f"kv_cache_dtype: expected one of {ROUND_TRIP_DTYPES}, got {dtype!r}")

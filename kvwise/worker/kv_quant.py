"""Quantized KV formats (``KVSpec`` documents them): quantize K/V rows as they are written into
the pool, dequantize them as attention reads them. Plain torch; kvwise's C++ writes
(``kv_write_int8`` in ``kernels/csrc/paged_attention.cpp``, ``kv_write_int4`` in
``kernels/csrc/kv_int4.cpp``) implement the same arithmetic, operation for operation, so a row
quantized by either has the same bytes.

- ``int8``: ``scale = amax * (1/127)`` per token and KV head (float32), ``q = round(x / scale)``
  computed as ``round(x * (127 / amax))``; ``x ≈ q * scale``. An all-zero row has scale 0.
- ``int4`` (``quantize_int4``): over each group of ``group`` values along the last dimension:
  ``min``, ``scale = (max - min) / 15``, both rounded to float16 first, then ``q =
  clamp(round((x - min) * (1 / scale)), 0, 15)``; ``x ≈ q * scale + min``. Two codes a byte:
  element ``2i`` in the low nibble, ``2i+1`` in the high one. The pool's int4 applies it to
  values per token (groups of channels) and to keys per channel over a sealed block
  (``quantize_int4_keys``: groups of tokens).
"""

from __future__ import annotations

import torch

from kvwise.core.kv_spec import INT4_BLOCK_SIZE, kv_format

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


def quantize_int4_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full blocks of keys ``(n, block_size, heads, D)`` float32 -> codes ``(n, heads, D,
    block_size // 2)`` uint8 (two tokens a byte) and ``(n, heads, D, 2)`` float16 (scale, min):
    one group per block, head and channel."""
    block_size = x.shape[1]
    codes, scale_min = quantize_int4(x.permute(0, 2, 3, 1), block_size)
    return codes, scale_min.squeeze(-2)


def dequantize_int4_keys(codes: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
    """``quantize_int4_keys``'s inverse: ``(n, block_size, heads, D)`` float32."""
    block_size = codes.shape[-1] * 2
    x = dequantize_int4(codes, scale_min.unsqueeze(-2), block_size)  # (n, heads, D, bs)
    return x.permute(0, 3, 1, 2)


KEY_BLOCK = INT4_BLOCK_SIZE  # int4: tokens per key block (the pool's block size for int4)


def round_trip(
    x: torch.Tensor, dtype: str, group: int = 0, keys: bool = False, key_block: int = KEY_BLOCK
) -> torch.Tensor:
    """``x`` ``(T, heads, D)`` float32 as a pool of ``dtype`` hands it back to attention
    (stored, then read), with no pool: what ``kvwise eval`` feeds dense attention to measure
    ``"int4-pt"`` (the formats the pool stores it measures through the pool itself), and the
    tests' reference of what a format keeps.

    The registered format says how (``core/kv_spec.KVFormat``): a float format's values as
    its torch dtype holds them; a quantized one's by the scales of the half (``keys`` or
    values): one per token (8-bit codes: int8), per group of ``group`` channels (4-bit), or
    per channel over each full block of ``key_block`` tokens (4-bit sealed keys: the last,
    partial block is returned as it is, as the pool keeps an unsealed block in full
    precision). ``"int4-pt"`` is measured only, never stored: keys per token like values
    (what 4-bit costs without KIVI's per-channel keys)."""
    fmt = kv_format(dtype)
    scales = fmt.key_scales if keys else fmt.value_scales
    if scales is None:
        if fmt.quantized or not hasattr(torch, dtype):
            raise ValueError(f"kv_cache_dtype: no round trip for {dtype!r}")
        return x.to(getattr(torch, dtype)).float()
    if scales.per == "channel" and fmt.bytes_per_value == 0.5:
        return _round_trip_sealed(x, key_block)
    if scales.per == "group" and fmt.bytes_per_value == 0.5:
        group = group or min(32, x.shape[-1])
        return dequantize_int4(*quantize_int4(x, group), group)
    if scales.per == "token" and fmt.bytes_per_value == 1:
        return dequantize_int8(*quantize_int8(x))
    raise ValueError(f"kv_cache_dtype: no round trip for {dtype!r} ({scales.describe()})")


def _round_trip_sealed(x: torch.Tensor, key_block: int) -> torch.Tensor:
    """Keys per channel over each full block of ``key_block`` tokens; the rest as it is."""
    if key_block < 2 or key_block % 2:
        raise ValueError(f"kv_key_block: expected an even number of tokens, got {key_block}")
    full = x.shape[0] // key_block * key_block
    if full == 0:
        return x
    blocks = x[:full].reshape(full // key_block, key_block, *x.shape[1:])
    back = dequantize_int4_keys(*quantize_int4_keys(blocks))
    return torch.cat([back.reshape(full, *x.shape[1:]), x[full:]])

"""GGUF's other block types at the file's own precision: Q5_0, Q5_1, Q2_K .. Q6_K and MXFP4.

Each type is, per block of 32 weights of an output row, unsigned codes `q` of 2..6 bits with
one scale (or two: sub-blocks of 16), an optional minimum and an optional integer offset,
`w = scale * (q - offset) - minimum`. The K-quants keep every scale and minimum as a small
integer times a float16 of the super-block of 256 (`scale = D * sc`, `minimum = Dmin * mn`),
Q5_0 / Q5_1 a float16 `d` (and `m`) per block. ``BlockWeight`` keeps exactly those numbers, in
the layout ``kernels/csrc/kquant.cpp`` reads (its header comment), so ``qkmm`` computes with the
file's own weights: the integer parts stay integers, the float16 parts float16 (a product
`D * sc` would need 17 bits: no float16 holds it). ``decode`` turns a tensor's raw GGUF blocks
into those numbers, with numpy, straight from the memory-mapped file.

MXFP4 (gpt-oss's experts): per block of 32, four-bit floats (e2m1) and one power-of-two scale
byte `e`, `w = v(q) * 2^(e - 128)` with `v` the e2m1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and
their negatives). The kernel keeps the file's codes and its `e` bytes (4.25 bits a weight, as
the file) and reads each code through a table as `v(q) + 12` with an offset of 12.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvwise import kernels
from kvwise.models.quant import QK, _float16_bytes, quantize_activations

QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class BlockSpec:
    """One GGUF block type as the kernel holds it (see kquant.cpp's ``Layout``)."""

    name: str
    kind: int  # qkmm's `kind`
    bits: int  # bits of a code as stored: 4 (2- and 3-bit codes too), 5 or 6
    kscales: bool  # int8 sub-block scales times a float16 per super-block
    halves: bool  # sub-blocks of 16: two scales a block of 32
    mins: bool
    offset: int
    fp4: bool = False  # MXFP4: codes are e2m1 floats, the scale a power-of-two byte

    @property
    def block_bytes(self) -> int:
        scale = 8 * (2 if self.halves else 1) if self.kscales else 8 if self.fp4 else 16
        return 128 + 32 * (self.bits - 4) + scale * (2 if self.mins else 1)

    @property
    def blocks(self) -> int:  # blocks of 32 a super-block
        return QK_K // QK if self.kscales else 1

    @property
    def header_bytes(self) -> int:
        return (32 if self.mins else 16) if self.kscales else 0

    @property
    def super_bytes(self) -> int:
        return self.header_bytes + self.blocks * self.block_bytes


SPECS = {
    spec.name: spec
    for spec in (
        BlockSpec("Q5_0", 0, 5, False, False, False, 16),
        BlockSpec("Q5_1", 1, 5, False, False, True, 0),
        BlockSpec("Q4_K", 2, 4, True, False, True, 0),
        BlockSpec("Q5_K", 3, 5, True, False, True, 0),
        BlockSpec("Q6_K", 4, 6, True, True, False, 32),
        BlockSpec("Q3_K", 5, 4, True, True, False, 4),
        BlockSpec("Q2_K", 6, 4, True, True, True, 0),
        BlockSpec("MXFP4", 7, 4, False, False, False, 12, fp4=True),
    )
}
# MXFP4's code -> its e2m1 value doubled (kquant.cpp's table less its offset of 12)
FP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


@dataclass
class Decoded:
    """A tensor's numbers as the kernel keeps them, rows first: codes `(rows, cols)` uint8;
    Q5_x: d, m `(rows, cols / 32)` float32 (float16 values); K-quants: D, Dmin `(rows, cols /
    256)` float32 (float16 values), sc, mn `(rows, cols / 32)` (or `(rows, cols / 32, 2)` for
    sub-blocks of 16) int8; MXFP4: its `e` bytes `(rows, cols / 32)` uint8 as the scale."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None = None
    sc: np.ndarray | None = None
    mn: np.ndarray | None = None


def _f16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)[..., 0]


def _bits(v: np.ndarray, shifts, mask: int) -> np.ndarray:
    """`(n, m)` bytes -> `(n, len(shifts), m)`: each byte shifted right by each shift, masked."""
    return (v[:, None, :] >> np.array(shifts, np.uint8)[None, :, None]) & np.uint8(mask)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums a super-block."""
    d, m, md = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    sc = np.concatenate((d & 63, (md & 15) | ((d >> 2) & 48)), axis=1)
    mn = np.concatenate((m & 63, (md >> 4) | ((m >> 2) & 48)), axis=1)
    return sc.astype(np.int8), mn.astype(np.int8)


def _decode_blocks(name: str, b: np.ndarray) -> Decoded:
    """`b` `(n, type bytes)`: n blocks (super-blocks for the K-quants) of one type -> codes
    `(n, block weights)` and the per-block numbers, all `(n, ...)`."""
    n = len(b)
    if name == "MXFP4":  # e, then 16 bytes: weight k in the low nibble, k + 16 in the high
        return Decoded(_bits(b[:, 1:17], (0, 4), 15).reshape(n, 32), b[:, 0].copy())
    if name in ("Q5_0", "Q5_1"):
        at = 2 if name == "Q5_0" else 4
        qh = np.ascontiguousarray(b[:, at : at + 4]).view(np.uint32)  # (n, 1)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # (n, 32)
        low = _bits(b[:, at + 4 : at + 20], (0, 4), 15).reshape(n, 32)
        minimum = _f16(b[:, 2:4]) if name == "Q5_1" else None
        return Decoded(low | (high << 4), _f16(b[:, 0:2]), minimum)
    if name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[:, 4:16])
        qs = b[:, 16:144] if name == "Q4_K" else b[:, 48:176]
        codes = _bits(qs.reshape(n * 4, 32), (0, 4), 15).reshape(n, 8, 32)
        if name == "Q5_K":
            codes |= _bits(b[:, 16:48], range(8), 1) << 4
        return Decoded(codes.reshape(n, QK_K), _f16(b[:, 0:2]), _f16(b[:, 2:4]), sc, mn)
    if name == "Q6_K":
        low = _bits(b[:, 0:128].reshape(n * 2, 64), (0, 4), 15).reshape(n, 2, 2, 2, 32)
        high = _bits(b[:, 128:192].reshape(n * 2, 32), (0, 2, 4, 6), 3).reshape(n, 2, 4, 32)
        codes = low.reshape(n, 2, 4, 32) | (high << 4)  # chunk 4 h + i
        sc = b[:, 192:208].view(np.int8).reshape(n, 8, 2)
        return Decoded(codes.reshape(n, QK_K), _f16(b[:, 208:210]), sc=sc)
    if name == "Q3_K":
        low = _bits(b[:, 32:96].reshape(n * 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
        high = _bits(b[:, 0:32], range(8), 1)  # (n, 8, 32)
        s = b[:, 96:108]
        lo = _bits(s[:, 0:8], (0, 4), 15).reshape(n, 16)
        hi = _bits(s[:, 8:12], (0, 2, 4, 6), 3).reshape(n, 16)
        sc = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, 8, 2)
        return Decoded((low | (high << 2)).reshape(n, QK_K), _f16(b[:, 108:110]), sc=sc)
    if name == "Q2_K":
        codes = _bits(b[:, 16:80].reshape(n * 2, 32), (0, 2, 4, 6), 3).reshape(n, QK_K)
        s = b[:, 0:16]
        sc, mn = (s & 15).astype(np.int8), (s >> 4).astype(np.int8)
        return Decoded(
            codes, _f16(b[:, 80:82]), _f16(b[:, 82:84]), sc.reshape(n, 8, 2), mn.reshape(n, 8, 2)
        )
    raise ValueError(f"weights: no block kernel for GGUF type {name}")


def decode(raw: np.ndarray, name: str, shape: tuple[int, int]) -> Decoded:
    """A `(out, in)` tensor's raw blocks (bytes, rows in order) -> its numbers, rows first."""
    spec = SPECS[name]
    rows, cols = shape
    per = spec.blocks * QK  # weights a (super-)block
    if cols % per:
        raise ValueError(f"weights: a {name} row of {cols} is not whole blocks of {per}")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows * (cols // per), -1)
    d = _decode_blocks(name, blocks)
    nb = cols // QK
    return Decoded(
        d.codes.reshape(rows, cols),
        d.scale.reshape(rows, -1),
        None if d.minimum is None else d.minimum.reshape(rows, -1),
        None if d.sc is None else d.sc.reshape(rows, nb, *d.sc.shape[2:]),
        None if d.mn is None else d.mn.reshape(rows, nb, *d.mn.shape[2:]),
    )


def _groups(t: torch.Tensor) -> torch.Tensor:
    """`(rows, nb, ...)` -> `(rows / 8, nb, ..., 8)`: 8 rows a group, the row innermost (rows
    padded with zeros to a multiple of 8)."""
    t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, -t.shape[0] % 8))
    t = t.reshape(t.shape[0] // 8, 8, *t.shape[1:])
    return t.movedim(1, -1)


def pack(spec: BlockSpec, d: Decoded) -> torch.Tensor:
    """The kernel's layout (kquant.cpp) of a decoded tensor: `(rows / 8, super-blocks, bytes)`."""
    codes = torch.from_numpy(np.ascontiguousarray(d.codes))
    rows, cols = codes.shape
    nb, G = cols // QK, -(-rows // 8)
    tail = []  # each block's scale bytes, then each super-block's header
    if spec.kscales:
        for ints in (d.sc, d.mn) if spec.mins else (d.sc,):
            t = _groups(torch.from_numpy(np.ascontiguousarray(ints)))  # (G, nb, [2,] 8)
            tail.append(t.contiguous().view(torch.uint8).reshape(G, nb, -1))
        floats = [f for f in (d.scale, d.minimum) if f is not None]
        heads = torch.cat([_float16_bytes(torch.from_numpy(f)) for f in floats], dim=-1)
    elif spec.fp4:  # the e bytes of a group's 8 columns
        tail.append(_groups(torch.from_numpy(np.ascontiguousarray(d.scale))).contiguous())
        heads = torch.zeros(G, nb, 0, dtype=torch.uint8)
    else:
        for floats in (d.scale, d.minimum) if spec.mins else (d.scale,):
            tail.append(_float16_bytes(torch.from_numpy(floats)))
        heads = torch.zeros(G, nb, 0, dtype=torch.uint8)
    tail_bytes = torch.cat(tail, dim=-1).contiguous()
    if kernels.available():
        return torch.ops.kvwise.qk_pack(
            codes, spec.bits, tail_bytes, heads.contiguous(), spec.blocks
        )
    blocks = torch.cat((_code_planes(spec, codes), tail_bytes), dim=-1)  # (G, nb, block bytes)
    nsb = nb // spec.blocks
    return torch.cat((heads, blocks.reshape(G, nsb, -1)), dim=-1).contiguous()


def _code_planes(spec: BlockSpec, codes: torch.Tensor) -> torch.Tensor:
    """Codes `(rows, cols)` -> each block's nibbles and bit planes `(G, nb, bytes)` (torch; the
    kernels' ``qk_pack`` makes the same bytes faster)."""
    rows, cols = codes.shape
    nb = cols // QK
    c = _groups(codes.reshape(rows, nb, QK)).permute(0, 1, 3, 2)  # (G, nb, 8 columns, 32)
    G = c.shape[0]
    lo = c[..., :16].reshape(G, nb, 8, 4, 4)  # (G, nb, column, j, t): k = 4 j + t
    hi = c[..., 16:].reshape(G, nb, 8, 4, 4)
    parts = [((lo & 15) | ((hi & 15) << 4)).permute(0, 1, 3, 2, 4).reshape(G, nb, 128)]
    weights = torch.tensor([1, 2, 4, 8], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    if spec.bits == 5:  # bit 4 of chunk j's codes in bit j (k < 16) and bit 4 + j (k >= 16)
        plane = (((lo >> 4) & 1) * weights).sum(3) + (((hi >> 4) & 1) * (weights << 4)).sum(3)
        parts.append(plane.to(torch.uint8).reshape(G, nb, 32))
    if spec.bits == 6:  # bits 4..5 of chunk j's codes in bits 2 j .. 2 j + 1
        for half in (lo, hi):
            plane = (((half >> 4) & 3) * (weights * weights)).sum(3)
            parts.append(plane.to(torch.uint8).reshape(G, nb, 32))
    return torch.cat(parts, dim=-1)


def unpack(spec: BlockSpec, packed: torch.Tensor) -> torch.Tensor:
    """The float32 `(G * 8, cols)` weight of packed column groups (the inverse of ``pack``
    followed by the block formula)."""
    G, nsb, _ = packed.shape
    nb = nsb * spec.blocks
    heads = packed[..., : spec.header_bytes]
    blocks = packed[..., spec.header_bytes :].reshape(G, nb, spec.block_bytes)
    nib = blocks[..., :128].reshape(G, nb, 4, 8, 4).permute(0, 1, 3, 2, 4).int()  # (G,nb,c,j,t)
    lo, hi = nib & 15, nib >> 4
    if spec.bits == 5:
        plane = blocks[..., 128:160].reshape(G, nb, 8, 1, 4).int()
        j = torch.arange(4).view(1, 1, 1, 4, 1)
        lo, hi = lo | (((plane >> j) & 1) << 4), hi | (((plane >> (4 + j)) & 1) << 4)
    if spec.bits == 6:
        j = torch.arange(4).view(1, 1, 1, 4, 1)
        a = blocks[..., 128:160].reshape(G, nb, 8, 1, 4).int()
        e = blocks[..., 160:192].reshape(G, nb, 8, 1, 4).int()
        lo, hi = lo | (((a >> (2 * j)) & 3) << 4), hi | (((e >> (2 * j)) & 3) << 4)
    q = torch.cat((lo.reshape(G, nb, 8, 16), hi.reshape(G, nb, 8, 16)), -1)
    if spec.fp4:
        q = torch.from_numpy(FP4_VALUES)[q.long()].float()  # (G, nb, column, 32)
    else:
        q = q.float() - spec.offset
    at = 128 + 32 * (spec.bits - 4)

    def halves(t: torch.Tensor) -> torch.Tensor:  # (G, nb, 8) or (G, nb, 2, 8) -> per k
        t = t.float()
        if t.dim() == 3:
            return t[..., None].expand(G, nb, 8, 32)
        return t.permute(0, 1, 3, 2).repeat_interleave(16, dim=-1)

    if spec.kscales:
        n = 16 if spec.halves else 8
        sc = blocks[..., at : at + n].contiguous().view(torch.int8)
        shape = (G, nb, 2, 8) if spec.halves else (G, nb, 8)
        big = heads[..., :16].contiguous().view(torch.float16).float()  # (G, nsb, 8)
        big = big.repeat_interleave(spec.blocks, dim=1)[..., None]  # (G, nb, 8, 1)
        w = big * halves(sc.reshape(shape)) * q
        if spec.mins:
            mn = blocks[..., at + n : at + 2 * n].contiguous().view(torch.int8).reshape(shape)
            small = heads[..., 16:32].contiguous().view(torch.float16).float()
            w = w - small.repeat_interleave(spec.blocks, dim=1)[..., None] * halves(mn)
    elif spec.fp4:  # 2^(e - 128), exactly (ldexp of 1)
        e = blocks[..., at : at + 8].int() - 128  # (G, nb, 8)
        w = torch.ldexp(torch.ones(e.shape), e.float())[..., None] * q
    else:
        d = blocks[..., at : at + 16].contiguous().view(torch.float16).float()  # (G, nb, 8)
        w = d[..., None] * q
        if spec.mins:
            w = (
                w
                + blocks[..., at + 16 : at + 32].contiguous().view(torch.float16).float()[..., None]
            )
    return w.permute(0, 2, 1, 3).reshape(G * 8, nb * QK)


class BlockWeight:
    """A linear weight (or embedding / LM head) in one GGUF block type, run by ``qkmm``.

    ``mm`` quantizes the activations as ``Int4Weight`` does and computes the exact block sums;
    ``rows`` / ``dot_rows`` give exact float32 rows (the embedding, the head's refinement).
    """

    def __init__(self, spec: BlockSpec, packed: torch.Tensor, out_features: int, in_features: int):
        self.spec, self.packed = spec, packed
        self.out_features, self.in_features = out_features, in_features

    @classmethod
    def from_gguf(cls, raw: np.ndarray, name: str, shape: tuple[int, int]) -> BlockWeight:
        """From a `(out, in)` tensor's raw GGUF blocks (rows in order)."""
        spec = SPECS[name]
        return cls(spec, pack(spec, decode(raw, name, shape)), *shape)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(T, in)` (any float dtype) -> `(T, out)` float32."""
        x = x.float().contiguous()
        if kernels.available():
            return torch.ops.kvwise.qkmm(x, self.packed, self.spec.kind)[:, : self.out_features]
        return quantize_activations(x) @ self.dequantize().t()  # the same up to float rounding

    def dequantize(self) -> torch.Tensor:
        return unpack(self.spec, self.packed)[: self.out_features]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) as float32 `(*ids.shape, in)`, exact."""
        flat = ids.reshape(-1)
        if kernels.available():
            rows = torch.ops.kvwise.qk_rows(self.packed, flat.contiguous(), self.spec.kind)
            return rows.reshape(*ids.shape, self.in_features)
        groups, at = torch.unique(flat // 8, return_inverse=True)
        decoded = unpack(self.spec, self.packed[groups]).view(len(groups), 8, self.in_features)
        return decoded[at, flat % 8].reshape(*ids.shape, self.in_features)

    def dot_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`x` `(N, in)`, `ids` `(N, k)` -> `(N, k)` float32: x[n] . row ids[n][i]."""
        if kernels.available():
            h, ids = x.float().contiguous(), ids.contiguous()
            return torch.ops.kvwise.qk_rows_dot(h, self.packed, ids, self.spec.kind)
        return torch.einsum("nkh,nh->nk", self.rows(ids), x.float())

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


class ConcatWeight:
    """Row blocks of a fused weight in different formats: each part's ``mm``, side by side."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.mm(x).float() for p in self.parts], dim=1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

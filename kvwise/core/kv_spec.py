"""``KVSpec``: the one owner of the KV layout. Pure Python.

Everything that needs to know how K/V bytes are laid out asks a ``KVSpec``: the worker's paged
cache (tensor shape and dtype), the entry format of the tiers (``store/serde.py``), the pool
sizing at start-up, ``kvwise size`` and the model fingerprint (``layout`` goes into the root of
every block hash and into every stored entry's header, so KV of one layout is never read as
another).

One block of one layer holds K and V for ``block_size`` tokens, each half (K, then V) as::

    codes (block_size, num_kv_heads, head_dim) of dtype  +  its scales

Float formats have no scales. The quantized formats keep their scales beside their codes, so a
block's half is one run of bytes in the pool and in every tier entry:

- ``int8``: symmetric, one float32 scale per token and KV head (``x = q * scale``);
- ``int4``: asymmetric 4-bit (``x = q * scale + min``, q in 0..15, each scale and minimum a
  float16), KIVI's layout: **keys per channel** over the block (codes ``(num_kv_heads,
  head_dim, block_size / 2)``, two tokens a byte, then a scale and minimum per head and
  channel), so a block's keys are quantized once it is full ("sealed"); **values per token**
  in groups of ``group_size`` channels (codes ``(block_size, num_kv_heads, head_dim / 2)``,
  two channels a byte, then a scale and minimum per token, head and group). The shorter half
  is padded to the longer one's size; the halves are equal when ``group_size ==
  block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

# bytes per element of each KV dtype; the worker stores the first three, the others are sizes
# for `kvwise size` (what a quantized cache would take)
KV_DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}
STORAGE_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")  # what the pool can hold
QUANTIZED_DTYPES = ("int8", "int4")
DEFAULT_INT4_GROUP = 32
DEFAULT_BLOCK_SIZE = 16
INT4_BLOCK_SIZE = 32  # int4's default block: its key scales are per block (see docs/BENCHMARKS.md)


def kv_formats() -> tuple[str, ...]:
    """The KV formats the pool can hold, in the order flags list them (the one list every
    choice and check reads)."""
    return STORAGE_DTYPES


def default_block_size(dtype: str) -> int:
    """The block size when none is given: 32 tokens for int4 (whose keys are scaled per block
    and channel: +0.9% perplexity at 2,048 tokens, 6.4x float32's tokens), else 16."""
    return INT4_BLOCK_SIZE if dtype == "int4" else DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"  # the storage dtype of K/V (may differ from the compute dtype)
    group_size: int = 0  # int4: channels per scale group (0: the default, 32); else unused

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(
                f"kv_cache_dtype: expected one of {sorted(KV_DTYPE_BYTES)}, got {self.dtype!r}"
            )
        if self.dtype == "int4":
            if self.block_size % 2:
                raise ValueError(
                    f"block_size: int4 KV packs two tokens a byte, expected an even block size, "
                    f"got {self.block_size}"
                )
            if self.group_size == 0:
                object.__setattr__(self, "group_size", min(DEFAULT_INT4_GROUP, self.head_dim))
            if (
                isinstance(self.group_size, bool)
                or not isinstance(self.group_size, int)
                or self.group_size < 2
                or self.group_size % 2
                or self.head_dim % self.group_size
            ):
                raise ValueError(
                    f"kv_int4_group_size: expected an even divisor of head_dim "
                    f"{self.head_dim}, got {self.group_size!r}"
                )
        elif self.group_size:
            raise ValueError(f"kv_int4_group_size: only for int4 KV, not {self.dtype}")

    @property
    def itemsize(self) -> float:
        return KV_DTYPE_BYTES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of K (or V) of one layer: ``(block_size, num_kv_heads, head_dim)``."""
        return self.block_size, self.num_kv_heads, self.head_dim

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The paged cache: ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, num_blocks, *self.block_shape)

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def codes_bytes(self) -> int:
        """Bytes of the K (or V) codes of one block in one layer."""
        return int(self.block_size * self.num_kv_heads * self.head_dim * self.itemsize)

    @property
    def key_scale_bytes(self) -> int:
        """Bytes of the scales beside one block's K codes in one layer; 0 for floats."""
        if self.dtype == "int4":
            return self.num_kv_heads * self.head_dim * 4  # float16 scale and min per channel
        return self.value_scale_bytes

    @property
    def value_scale_bytes(self) -> int:
        """Bytes of the scales beside one block's V codes in one layer; 0 for floats."""
        rows = self.block_size * self.num_kv_heads
        if self.dtype == "int8":
            return rows * 4  # float32 scale
        if self.dtype == "int4":
            return rows * (self.head_dim // self.group_size) * 4  # float16 scale and min
        return 0

    @property
    def scale_bytes(self) -> int:
        """Bytes after the codes in each half of a block: the longer half's scales (the other
        half is padded to it)."""
        return max(self.key_scale_bytes, self.value_scale_bytes)

    @property
    def half_block_bytes(self) -> int:
        """Bytes of K (or V) of one block in one layer: codes and their scales."""
        return self.codes_bytes + self.scale_bytes

    @property
    def side_bytes(self) -> int:
        """Bytes of scales (and padding) in one block of one layer (K and V)."""
        return 2 * self.scale_bytes

    @property
    def sealed_keys(self) -> bool:
        """Keys are quantized per block (int4): a block's keys are written when it is full;
        until then the worker keeps them in full precision."""
        return self.dtype == "int4"

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block's K and V (scales included) in one layer."""
        return 2 * self.half_block_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of every layer."""
        return self.num_layers * self.layer_block_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_size

    def num_blocks_in(self, num_bytes: int) -> int:
        """How many whole blocks a byte budget holds."""
        return int(num_bytes) // self.block_bytes

    @property
    def dtype_tag(self) -> str:
        """The storage format in at most 8 characters (entry headers): dtype, and the group."""
        return f"i4kcg{self.group_size}" if self.dtype == "int4" else self.dtype

    @property
    def layout(self) -> str:
        """The layout as a string, for the hash root and for entry headers."""
        return (
            f"L{self.num_layers}.KV{self.num_kv_heads}.D{self.head_dim}.B{self.block_size}"
            f".{self.dtype_tag}"
        )

"""``KVSpec``: the one owner of the KV layout. Pure Python.

Everything that needs to know how K/V bytes are laid out asks a ``KVSpec``: the worker's paged
cache (tensor shape and dtype), the entry format of the tiers (``store/serde.py``), the pool
sizing at start-up, ``kvwise size`` and the model fingerprint (``layout`` goes into the root of
every block hash and into every stored entry's header, so KV of one layout is never read as
another).

One block of one layer holds K and V for ``block_size`` tokens::

    (2, block_size, num_kv_heads, head_dim) of dtype  +  side_bytes of side data

``side_bytes`` is per-block side data of one layer (quantization scales, for formats that
need them); the float formats have none.
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
STORAGE_DTYPES = ("float32", "bfloat16", "float16")  # what the paged cache can hold today


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"  # the storage dtype of K/V (may differ from the compute dtype)
    side_bytes: int = 0  # per-block side data of one layer (scales); 0 for float formats

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(
                f"kv_cache_dtype: expected one of {sorted(KV_DTYPE_BYTES)}, got {self.dtype!r}"
            )
        if (
            isinstance(self.side_bytes, bool)
            or not isinstance(self.side_bytes, int)
            or self.side_bytes < 0
        ):
            raise ValueError(f"side_bytes: expected an integer >= 0, got {self.side_bytes!r}")

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
    def half_block_bytes(self) -> int:
        """Bytes of K (or V) of one block in one layer, side data excluded."""
        return int(self.block_size * self.num_kv_heads * self.head_dim * self.itemsize)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block's K and V (and side data) in one layer."""
        return 2 * self.half_block_bytes + self.side_bytes

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
    def layout(self) -> str:
        """The layout as a string, for the hash root and for entry headers."""
        side = f".S{self.side_bytes}" if self.side_bytes else ""
        return (
            f"L{self.num_layers}.KV{self.num_kv_heads}.D{self.head_dim}.B{self.block_size}"
            f".{self.dtype}{side}"
        )

"""``KVSpec``: the one owner of the KV layout, and the registry of KV formats. Pure Python.

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

The formats are registered here, once each, in the order flags list them: a ``KVFormat`` holds
a format's layout facts (bytes per value, its scales, its layout tag, whether its keys are
sealed, its default block size) and what it is for (``uses``): ``"pool"`` (the paged pool stores
it: ``worker/kv_cache`` registers its tensor class under the same name), ``"size"`` (``kvwise
size`` can size it) and ``"eval"`` (``kvwise eval`` can measure it). ``fp8`` is only a size;
``int4-pt`` (int4 with keys per token) only an eval round trip. ``kv_formats(use)`` lists them.

Hybrid models (Gemma 2/3, Qwen2 with some windowed layers): ``kv_groups`` puts the layers into
*KV groups* of one attention type and equal size (vLLM's hybrid KV cache manager): each group
has its own block table over one shared pool, and a block (a *page*) holds K/V of one group's
layers, ``page_layers`` of them. A ``KVSpec`` with ``groups`` is the spec of such a page
(``num_layers`` is then ``page_layers``): the pool tensor, the tiers' entries and the byte
counts all see pages, while ``groups`` says which model layers each group's slots hold and
what window its layers attend over. Gemma 3 270M (15 layers windowed at 512, 3 full): groups
of 3 layers, 5 windowed and 1 full::

    slot:        0   1   2
    group 0:     5  11  17    (full: keeps every block)
    group 1:     0   1   2    (window 512: frees the blocks before its window)
    group 2:     3   4   6
    ...
    group 5:    14  15  16
"""

from __future__ import annotations

from dataclasses import dataclass

USES = ("pool", "size", "eval")
DEFAULT_BLOCK_SIZE = 16
DEFAULT_INT4_GROUP = 32
INT4_BLOCK_SIZE = 32  # int4's default block: its key scales are per block (see docs/BENCHMARKS.md)
MAX_TAG_CHARS = 8  # the dtype field of a stored entry's header (store/serde.py)
SCALE_UNITS = ("token", "channel", "group")


@dataclass(frozen=True)
class Scales:
    """The scales after one block half's codes: ``nbytes`` bytes each, one per ``per``:

    - ``"token"``: token and KV head (``block_size * num_kv_heads``);
    - ``"channel"``: KV head and channel, over the whole block (``num_kv_heads * head_dim``);
    - ``"group"``: token, KV head and group of ``group_size`` channels.
    """

    per: str
    nbytes: int

    def __post_init__(self) -> None:
        if self.per not in SCALE_UNITS:
            raise ValueError(f"per: expected one of {SCALE_UNITS}, got {self.per!r}")

    def describe(self) -> str:
        """In words, e.g. "4 B per token and KV head"."""
        per = {
            "token": "token and KV head",
            "channel": "KV head and channel over a block",
            "group": "token, KV head and group of channels",
        }[self.per]
        return f"{self.nbytes} B per {per}"

    def bytes_in(self, spec: KVSpec) -> int:
        """Bytes of these scales in one block half of ``spec``."""
        if self.per == "token":
            return spec.block_size * spec.num_kv_heads * self.nbytes
        if self.per == "channel":
            return spec.num_kv_heads * spec.head_dim * self.nbytes
        groups = spec.head_dim // spec.group_size
        return spec.block_size * spec.num_kv_heads * groups * self.nbytes


@dataclass(frozen=True)
class KVFormat:
    """The layout facts of one KV format (see the module docstring)."""

    name: str
    bytes_per_value: float  # one K or V value's code, its scales apart
    uses: tuple[str, ...] = USES
    tag: str = ""  # in the layout string and entry headers ("{group}": the group size); "": name
    key_scales: Scales | None = None  # None: no scales (a float format)
    value_scales: Scales | None = None
    sealed_keys: bool = False  # keys quantized per block once it is full (the worker stages)
    grouped: bool = False  # takes a group size (KVSpec.group_size; default min(32, head_dim))
    block_multiple: int = 1  # block sizes must be multiples of this (int4: two tokens a byte)
    default_block_size: int = DEFAULT_BLOCK_SIZE
    note: str = ""  # what ``describe`` adds (e.g. "size only")

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        if not self.tag:
            object.__setattr__(self, "tag", self.name)
        if len(self.tag.replace("{group}", "128")) > MAX_TAG_CHARS or not self.tag.isascii():
            raise ValueError(f"tag: at most {MAX_TAG_CHARS} ASCII characters, got {self.tag!r}")
        if not self.uses or not set(self.uses) <= set(USES):
            raise ValueError(f"uses: expected some of {USES}, got {self.uses!r}")
        if self.bytes_per_value <= 0:
            raise ValueError(f"bytes_per_value: expected > 0, got {self.bytes_per_value!r}")

    @property
    def quantized(self) -> bool:
        """Codes with scales beside them (a lossy format; attention reads back what it stores)."""
        return self.key_scales is not None or self.value_scales is not None

    def describe(self) -> str:
        """What one value costs, with the scales beside the codes, in words (``kvwise
        size``'s table), e.g. "1 B + scales: keys 4 B per token and KV head, values ..."."""
        text = f"{self.bytes_per_value:g} B"
        if self.quantized:
            halves = (("keys", self.key_scales), ("values", self.value_scales))
            text += " + scales: " + ", ".join(
                f"{half} {scales.describe()}" for half, scales in halves if scales is not None
            )
        return f"{text} ({self.note})" if self.note else text

    def layout_tag(self, group_size: int) -> str:
        return self.tag.replace("{group}", str(group_size))


_FORMATS: dict[str, KVFormat] = {}


def register_kv_format(fmt: KVFormat) -> None:
    """Add a KV format at the end of the order. Its tag must be its own (another format's
    entries would otherwise be read as its own). A format the pool stores also needs its tensor
    class (``kvwise.worker.kv_cache.register_kv_cache``)."""
    if fmt.name in _FORMATS:
        raise ValueError(f"kv format {fmt.name!r} is registered already")
    for other in _FORMATS.values():
        if other.tag == fmt.tag:
            raise ValueError(f"tag: {fmt.tag!r} is {other.name}'s already")
    _FORMATS[fmt.name] = fmt


def unregister_kv_format(name: str) -> None:
    """Remove a format registered by ``register_kv_format`` (tests of a toy format)."""
    _FORMATS.pop(name, None)


def kv_formats(use: str = "pool") -> tuple[str, ...]:
    """The registered KV formats with the use ``use``, in order: ``"pool"`` (the default: what
    ``kv_cache_dtype`` accepts), ``"size"`` (``kvwise size``) or ``"eval"`` (``kvwise eval``)."""
    if use not in USES:
        raise ValueError(f"use: expected one of {USES}, got {use!r}")
    return tuple(name for name, fmt in _FORMATS.items() if use in fmt.uses)


def kv_format(name: str) -> KVFormat:
    """The registered format ``name``.

    Raises:
        ValueError: no format of that name (the message lists them).
    """
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"kv_cache_dtype: expected one of {tuple(_FORMATS)}, got {name!r}")
    return fmt


def default_block_size(dtype: str) -> int:
    """The block size when none is given: 32 tokens for int4 (whose keys are scaled per block
    and channel: +0.9% perplexity at 2,048 tokens, 6.4x float32's tokens), else 16; a name
    that is no format's (``"auto"``) gets 16."""
    fmt = _FORMATS.get(dtype)
    return fmt.default_block_size if fmt is not None else DEFAULT_BLOCK_SIZE


_INT8_SCALES = Scales("token", 4)  # a float32 scale per token and head
for _fmt in (
    KVFormat("float32", 4),
    KVFormat("bfloat16", 2),
    KVFormat("float16", 2),
    KVFormat("int8", 1, key_scales=_INT8_SCALES, value_scales=_INT8_SCALES),
    KVFormat(
        "int4",
        0.5,
        tag="i4kcg{group}",
        key_scales=Scales("channel", 4),  # a float16 scale and minimum per head and channel
        value_scales=Scales("group", 4),  # ... per token, head and group of channels
        sealed_keys=True,
        note="a float16 scale and minimum",
        grouped=True,
        block_multiple=2,
        default_block_size=INT4_BLOCK_SIZE,
    ),
    # measured by kvwise eval only: int4 with keys per token like values (no sealed blocks)
    KVFormat(
        "int4-pt",
        0.5,
        uses=("eval",),
        tag="i4ptg{group}",
        key_scales=Scales("group", 4),
        value_scales=Scales("group", 4),
        grouped=True,
    ),
    KVFormat("fp8", 1, uses=("size",), note="one scale per tensor; size only, not stored"),
):
    register_kv_format(_fmt)
del _fmt


@dataclass(frozen=True)
class KVGroup:
    """Model layers that share one block table; ``layers[j]`` is the layer in slot ``j`` of
    the group's pages. ``window``: the tokens each query sees (0: full attention)."""

    layers: tuple[int, ...]
    window: int = 0


def kv_groups(windows: list[int] | tuple[int, ...]) -> tuple[KVGroup, ...]:
    """Each layer's window (0: full) → KV groups of one window each and of equal size, full
    attention first: ``()`` where every layer is full attention (one table for all), one
    group of every layer where they all share one window.

    The group size is the fewest layers of any kind (the most, when the kinds' counts are
    within 25% of each other: less padding than splitting), as in vLLM; a kind whose count is
    not a multiple of it gets a smaller last group (its pages' other slots go unused).
    """
    by_kind: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        by_kind.setdefault(int(window), []).append(layer)
    if set(by_kind) <= {0}:
        return ()
    counts = [len(v) for v in by_kind.values()]
    size = min(counts)
    if max(counts) < 1.25 * size:
        size = max(counts)
    groups = []
    for window in sorted(by_kind):
        layers = by_kind[window]
        groups += [
            KVGroup(tuple(layers[i : i + size]), window) for i in range(0, len(layers), size)
        ]
    return tuple(groups)


def first_window_block(window: int, block_size: int, position: int) -> int:
    """The first block a query at ``position`` reads in a layer of ``window`` (0: full): its
    keys are at ``position - window < j <= position``."""
    return max(0, position - window + 1) // block_size if window else 0


def held_blocks(window: int, block_size: int, num_tokens: int, step_tokens: int = 1) -> int:
    """Blocks a group of ``window`` holds for a sequence of ``num_tokens`` tokens while its
    last ``step_tokens`` are computed."""
    first = first_window_block(window, block_size, max(0, num_tokens - step_tokens))
    return -(-num_tokens // block_size) - first


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"  # the storage format of K/V (may differ from the compute dtype)
    group_size: int = 0  # grouped formats (int4): channels per scale group (0: 32); else unused
    groups: tuple[KVGroup, ...] = ()  # hybrid KV groups (num_layers: layers a page); (): one

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        fmt = _FORMATS.get(self.dtype)
        if fmt is None or not {"pool", "size"} & set(fmt.uses):
            known = tuple(n for n, f in _FORMATS.items() if {"pool", "size"} & set(f.uses))
            raise ValueError(f"kv_cache_dtype: expected one of {known}, got {self.dtype!r}")
        if self.block_size % fmt.block_multiple:
            raise ValueError(
                f"block_size: {self.dtype} KV packs {fmt.block_multiple} tokens a byte, expected "
                f"a multiple of {fmt.block_multiple}, got {self.block_size}"
            )
        if fmt.grouped:
            self._check_group()
        elif self.group_size:
            raise ValueError(f"kv_int4_group_size: only for int4 KV, not {self.dtype}")
        if any(not 0 < len(g.layers) <= self.num_layers for g in self.groups):
            raise ValueError(f"groups: each holds 1 to num_layers ({self.num_layers}) layers")

    def _check_group(self) -> None:
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

    @property
    def format(self) -> KVFormat:
        """The registered ``KVFormat`` of ``dtype``."""
        return _FORMATS[self.dtype]

    @property
    def itemsize(self) -> float:
        return self.format.bytes_per_value

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of K (or V) of one layer: ``(block_size, num_kv_heads, head_dim)``."""
        return self.block_size, self.num_kv_heads, self.head_dim

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The paged cache: ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, num_blocks, *self.block_shape)

    @property
    def quantized(self) -> bool:
        return self.format.quantized

    @property
    def codes_bytes(self) -> int:
        """Bytes of the K (or V) codes of one block in one layer."""
        return int(self.block_size * self.num_kv_heads * self.head_dim * self.itemsize)

    @property
    def key_scale_bytes(self) -> int:
        """Bytes of the scales beside one block's K codes in one layer; 0 for floats."""
        scales = self.format.key_scales
        return 0 if scales is None else scales.bytes_in(self)

    @property
    def value_scale_bytes(self) -> int:
        """Bytes of the scales beside one block's V codes in one layer; 0 for floats."""
        scales = self.format.value_scales
        return 0 if scales is None else scales.bytes_in(self)

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
        return self.format.sealed_keys

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
        """The storage format in at most 8 characters (entry headers): its tag, with the group
        size of a grouped format (``i4kcg32``)."""
        return self.format.layout_tag(self.group_size)

    @property
    def layout(self) -> str:
        """The layout as a string, for the hash root and for entry headers (a hybrid spec's
        names its groups: ``.G`` + each group's window, ``f`` for full)."""
        layout = (
            f"L{self.num_layers}.KV{self.num_kv_heads}.D{self.head_dim}.B{self.block_size}"
            f".{self.dtype_tag}"
        )
        if self.groups:
            layout += ".G" + "-".join(str(g.window or "f") for g in self.groups)
        return layout

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The groups; a spec without hybrid groups has one full group of every layer."""
        return self.groups or (KVGroup(tuple(range(self.num_layers))),)

    @property
    def num_model_layers(self) -> int:
        return sum(len(g.layers) for g in self.kv_groups)

    def group_blocks(self, group: KVGroup, num_tokens: int, step_tokens: int = 1) -> int:
        """Blocks ``group`` holds for a sequence of ``num_tokens`` tokens while computing its
        last ``step_tokens`` (a windowed group: the blocks of the window before the first of
        them, and theirs)."""
        return held_blocks(group.window, self.block_size, num_tokens, step_tokens)

    def seq_blocks(self, num_tokens: int, step_tokens: int = 1) -> int:
        """Blocks (pages) one sequence of ``num_tokens`` tokens holds in every group."""
        return sum(self.group_blocks(g, num_tokens, step_tokens) for g in self.kv_groups)

    def seq_bytes(self, num_tokens: int) -> int:
        """Bytes of KV one sequence of ``num_tokens`` tokens holds (every group)."""
        return self.seq_blocks(num_tokens) * self.block_bytes

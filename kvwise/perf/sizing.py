"""KV-cache arithmetic for ``kvwise size``. No torch. The byte counts are ``KVSpec``'s (the
one owner of the KV layout), for hypothetical head counts and dtypes too.

KV bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes per element. With
multi-head attention kv_heads = heads; grouped-query attention shares each K/V head among
several query heads (kv_heads < heads); multi-query attention keeps one (kv_heads = 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvwise.core.kv_spec import KVSpec, default_block_size, kv_format, kv_formats


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})"
            )
        if self.dtype not in kv_formats("size"):
            raise ValueError(f"dtype: expected one of {kv_formats('size')}, got {self.dtype!r}")

    @property
    def spec(self) -> KVSpec:
        block_size = default_block_size(self.dtype)  # int4's key scales are per block
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, block_size, self.dtype)

    @property
    def bytes_per_token(self) -> float:
        return self.spec.bytes_per_token

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def with_kv_heads(self, num_kv_heads: int) -> KVShape:
        return KVShape(self.num_layers, self.num_heads, num_kv_heads, self.head_dim, self.dtype)


def shape_from_model(path: str | Path | None, dtype: str) -> tuple[KVShape, str]:
    """Read a config.json, an HF directory or a GGUF (None: the default model)."""
    p = model_file(path)
    if p.suffix == ".gguf":
        shape = _gguf_shape(p, dtype)  # its metadata alone: no torch, no vocabulary parsed
        if shape is not None:
            return shape, p.name
    arch, name = arch_from_model(p)
    shape = KVShape(arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim, dtype)
    return shape, name


def _gguf_shape(path: Path, dtype: str) -> KVShape | None:
    """The KV shape from a GGUF's metadata keys, read as ``ModelArchConfig.from_gguf`` reads
    them (head dim: ``attention.key_length``, else hidden / heads); None where the fast reader
    does not apply (the full reader then decides, with its own errors).

    NOTE: these are llama.cpp's keys for every architecture, so a GGUF of an architecture
    kvwise does not run is sized too (the arithmetic holds; nothing loads it)."""
    from kvwise.perf.gguf_meta import read_scalars

    meta = read_scalars(path)
    arch = meta.get("general.architecture") if meta is not None else None
    if not isinstance(arch, str):
        return None
    layers = meta.get(f"{arch}.block_count")
    heads = meta.get(f"{arch}.attention.head_count")
    hidden = meta.get(f"{arch}.embedding_length")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    key_length = meta.get(f"{arch}.attention.key_length", 0)
    if not all(_is_count(v) for v in (layers, heads, hidden, kv_heads)) or not (
        key_length == 0 or _is_count(key_length)
    ):
        return None  # e.g. head counts given per layer (an array)
    return KVShape(layers, heads, kv_heads, key_length or hidden // heads, dtype)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def arch_from_model(path: str | Path | None):
    """The ``ModelArchConfig`` of a config.json, an HF directory or a GGUF (None: the default
    model), and the file's name."""
    import json

    from kvwise.models.arch_load import arch_from_gguf, arch_from_hf_config

    p = model_file(path)
    if p.suffix == ".gguf":
        from kvwise.models.gguf_weights import open_gguf

        arch = arch_from_gguf(open_gguf(p))
    else:
        try:
            arch = arch_from_hf_config(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"model: cannot read '{p}': {e}") from e
    return arch, p.name


def model_file(path: str | Path | None) -> Path:
    """The file a model path names: a GGUF or config.json (a directory's config.json, else its
    first GGUF); None: the default model."""
    from kvwise.models.default import default_model_path

    p = Path(path) if path is not None else default_model_path()
    if not p.exists():
        raise ValueError(f"model: path '{p}' does not exist")
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        p = p / "config.json" if (p / "config.json").exists() or not ggufs else ggufs[0]
    return p


def hybrid_summary(spec: KVSpec, lengths: tuple[int, ...] = (2048, 8192, 32768)) -> str:
    """A hybrid spec's groups and what a sequence holds at a few lengths, against every layer
    holding every token (the start-up line, ``kvwise size``)."""
    kinds: dict[int, int] = {}
    for g in spec.groups:
        kinds[g.window] = kinds.get(g.window, 0) + 1
    groups = ", ".join(f"{n} {'full' if w == 0 else f'window {w}'}" for w, n in kinds.items())
    full = spec.num_model_layers * spec.layer_block_bytes  # a block of every layer
    per_len = "; ".join(
        f"{n:,} tokens {_mib(spec.seq_bytes(n))} "
        f"({spec.seq_bytes(n) / (-(-n // spec.block_size) * full):.0%} of all-full)"
        for n in lengths
    )
    return f"hybrid, {len(spec.groups)} groups of {spec.num_layers} layers ({groups}); {per_len}"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:,.2f} GB ({num_bytes / 2**30:,.2f} GiB)"


def report(
    shape: KVShape, num_tokens: int, batch: int, memory_bytes: int | None, latent: bool = False
) -> str:
    """A plain-text report: per token, per request, per batch, what fits, MHA/GQA/MQA (not
    for a ``latent`` cache: its one head is a latent row, ``latent_summary`` compares it)."""
    per_token = shape.bytes_per_token
    lines = [
        f"{shape.num_layers} layers, {shape.num_heads} query heads, {shape.num_kv_heads} KV "
        f"heads ({shape.attention_kind}), head_dim {shape.head_dim}, {shape.dtype}",
        f"KV per token:   2 x {shape.num_layers} x {shape.num_kv_heads} x {shape.head_dim} x "
        f"{kv_format(shape.dtype).describe()} = {per_token:,.0f} B "
        f"({per_token / 1024:,.1f} KiB)",
        f"per request:    {num_tokens:,} tokens = {_gb(per_token * num_tokens)}",
        f"per batch:      {batch} x {num_tokens:,} tokens = {_gb(per_token * num_tokens * batch)}",
    ]
    if memory_bytes is not None:
        fit = int(memory_bytes // per_token)
        lines.append(
            f"in {_gb(memory_bytes)}: {fit:,} tokens = {fit // num_tokens:,} requests of "
            f"{num_tokens:,} tokens"
        )
    if latent:
        return "\n".join([*lines, "", format_table(shape, num_tokens, batch, memory_bytes)])
    lines += [
        "",
        "| attention | KV heads | per token | per request | per batch | vs MHA |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    variants = [shape.num_heads]
    for kv in (shape.num_heads // 4, shape.num_heads // 8, shape.num_kv_heads, 1):
        if kv >= 1 and shape.num_heads % kv == 0 and kv not in variants:
            variants.append(kv)
    mha = shape.with_kv_heads(shape.num_heads).bytes_per_token
    for kv in sorted(variants, reverse=True):
        s = shape.with_kv_heads(kv)
        b = s.bytes_per_token
        lines.append(
            f"| {s.attention_kind} | {kv} | {b / 1024:,.1f} KiB | {b * num_tokens / 1e9:,.2f} GB "
            f"| {b * num_tokens * batch / 1e9:,.2f} GB | {b / mha:.3f}x |"
        )
    lines += ["", format_table(shape, num_tokens, batch, memory_bytes)]
    return "\n".join(lines)


def format_table(shape: KVShape, num_tokens: int, batch: int, memory_bytes: int | None) -> str:
    """Every KV format at this shape: bytes per token with their scales, per request, per
    batch, and the tokens ``memory_bytes`` holds."""
    lines = [
        "| KV format | per element | per token | per request | per batch | vs float16 |"
        + (" tokens in memory |" if memory_bytes else ""),
        "|---|---|---:|---:|---:|---:|" + ("---:|" if memory_bytes else ""),
    ]
    half = KVShape(
        shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, "float16"
    ).bytes_per_token
    for dtype in kv_formats("size"):
        try:
            b = KVShape(
                shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, dtype
            ).bytes_per_token
        except ValueError:  # a format this shape cannot hold (int4: an odd head_dim)
            continue
        row = (
            f"| {dtype} | {kv_format(dtype).describe()} | {b:,.0f} B | {b * num_tokens / 1e9:,.3f} GB "
            f"| {b * num_tokens * batch / 1e9:,.2f} GB | {b / half:.3f}x |"
        )
        if memory_bytes:
            row += f" {int(memory_bytes // b):,} |"
        lines.append(row)
    return "\n".join(lines)


def gguf_weight_report(path: str | Path | None) -> str | None:
    """The weights of a GGUF (None: the default model) as ``quantization="auto"`` holds them,
    per tensor type (``models/gguf_types.py``): a Markdown table; None for a non-GGUF model."""
    from kvwise.models.gguf_file import GGUFFile
    from kvwise.models.gguf_types import resident_bytes
    from kvwise.perf.gguf_meta import read_scalars

    p = model_file(path)
    if p.suffix != ".gguf":
        return None
    reader = GGUFFile(p)
    names = {t.name for t in reader.tensors}
    infos = [(t.name, t.tensor_type.name, int(t.n_elements)) for t in reader.tensors]
    files: dict[str, int] = {}
    for t in reader.tensors:
        files[t.tensor_type.name] = files.get(t.tensor_type.name, 0) + int(t.n_bytes)
    meta = read_scalars(p) or {}
    arch = meta.get("general.architecture")
    counts = (meta.get(f"{arch}.attention.head_count"), meta.get(f"{arch}.attention.head_count_kv"))
    heads = (int(counts[0]), int(counts[1] or counts[0])) if _is_count(counts[0]) else None
    held = resident_bytes(infos, tied="output.weight" not in names, heads=heads)
    lines = ["| GGUF type | in the file | runs as | resident |", "|---|---:|---|---:|"]
    for (kind, how), size in sorted(held.items()):
        lines.append(f"| {kind} | {files[kind] / 1e9:.3f} GB | {how} | {size / 1e9:.3f} GB |")
    total_file, total = sum(files.values()), sum(held.values())
    lines.append(
        f"| all | {total_file / 1e9:.3f} GB | | {total / 1e9:.3f} GB ({total / total_file:.2f}x) |"
    )
    return "\n".join(lines)


def latent_summary(arch, dtype: str, num_tokens: int, memory_bytes: int | None) -> str | None:
    """For a model with latent attention (DeepSeek's MLA; None for any other): what its cache
    holds a token (one latent row a layer, as K and V of 1 KV head: the V half the same row)
    against the same model with each head's K and V expanded, as GQA-style attention would
    cache them; and how many ``num_tokens``-token sequences ``memory_bytes`` holds each way."""
    if not arch.kv_lora_rank:
        return None
    block = default_block_size(dtype)
    latent = KVSpec(arch.num_layers, 1, arch.head_dim, block, dtype).bytes_per_token
    heads = arch.num_heads
    # expanded: H heads of (nope + rope) keys and v values: as K and V of H heads of their mean
    width = (arch.qk_nope_head_dim + arch.qk_rope_head_dim + arch.v_head_dim) / 2
    expanded = KVSpec(arch.num_layers, heads, round(width), block, dtype).bytes_per_token
    lines = [
        f"latent attention (MLA): the cache holds one row of kv_lora_rank + qk_rope_head_dim = "
        f"{arch.head_dim} a token and layer (stored as K and V: the V half the same row): "
        f"{latent:,.0f} B a token ({dtype}); the heads' K/V expanded ({heads} heads of "
        f"{arch.qk_nope_head_dim + arch.qk_rope_head_dim} + {arch.v_head_dim}): "
        f"{expanded:,.0f} B, {expanded / latent:.2f}x the latent's",
    ]
    if memory_bytes:
        lines.append(
            f"{num_tokens:,}-token sequences in {memory_bytes / 2**30:.1f} GiB: "
            f"{memory_bytes // (latent * num_tokens):,.0f} latent, "
            f"{memory_bytes // (expanded * num_tokens):,.0f} expanded"
        )
    return "\n".join(lines)

"""Engine configuration: frozen dataclasses, validated on construction (ValueError naming the field).

``EngineConfig.from_kwargs(**kw)`` is how the offline API and the CLI build one from flat
keywords such as ``block_size=16, kv_cache_memory="2GiB", max_num_seqs=16``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvwise.utils import parse_bytes

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's own context length
    num_threads: int | None = None  # torch intra-op threads; None: torch's default

    def __post_init__(self) -> None:
        if self.model is not None:
            if not isinstance(self.model, (str, Path)):
                raise ValueError(f"model: expected a path, got {self.model!r}")
            object.__setattr__(self, "model", str(self.model))
            if not Path(self.model).exists():
                raise ValueError(f"model: path '{self.model}' does not exist")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: expected one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        _positive_or_none("max_model_len", self.max_model_len)
        _positive_or_none("num_threads", self.num_threads)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes or "2GiB"; None: a fraction of free RAM
    kv_cache_memory_fraction: float = 0.2
    enable_kv_cache: bool = True  # False: recompute the whole prefix at every step
    enable_prefix_caching: bool = True
    public_prefixes: tuple[str, ...] = ()  # texts whose KV every tenant may share
    public_system_prompts: tuple[str, ...] = ()  # the same, rendered as chat system messages
    public_prefix_min_tokens: int = 256  # public prefixes are shared in chunks of this size
    max_retained_fraction_per_tenant: float = 0.5  # share of the pool one tenant may keep

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.kv_cache_memory is not None:
            object.__setattr__(
                self, "kv_cache_memory", parse_bytes(self.kv_cache_memory, "kv_cache_memory")
            )
        for name in ("public_prefixes", "public_system_prompts"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            object.__setattr__(self, name, value)
            if not all(isinstance(p, str) and p for p in value):
                raise ValueError(f"{name}: each must be a non-empty string")
        _positive_int("public_prefix_min_tokens", self.public_prefix_min_tokens)
        if self.public_prefix_min_tokens < self.block_size:
            raise ValueError(
                f"public_prefix_min_tokens: must be at least block_size ({self.block_size}), "
                f"got {self.public_prefix_min_tokens}"
            )
        if not 0 <= self.max_retained_fraction_per_tenant <= 1:
            raise ValueError(
                "max_retained_fraction_per_tenant: must be in [0, 1], "
                f"got {self.max_retained_fraction_per_tenant}"
            )
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                "kv_cache_memory_fraction: must be in (0, 0.95], "
                f"got {self.kv_cache_memory_fraction}"
            )

    def kv_cache_bytes(self) -> int:
        """The KV pool's byte budget: explicit, or a fraction of available memory."""
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        return int(available_memory_bytes() * self.kv_cache_memory_fraction)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # cap on running requests
    max_num_batched_tokens: int = 2048  # token budget of one step
    prefill_chunk_size: int | None = 512  # most prompt tokens of one request in one step
    max_waiting: int | None = None  # None: unbounded waiting queue

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_or_none("prefill_chunk_size", self.prefill_chunk_size)
        _positive_or_none("max_waiting", self.max_waiting)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from flat keywords; an unknown keyword is a ValueError naming it."""
        parts: dict[str, dict[str, object]] = {"model": {}, "cache": {}, "scheduler": {}}
        owners = {
            f.name: part
            for part, klass in (
                ("model", ModelConfig),
                ("cache", CacheConfig),
                ("scheduler", SchedulerConfig),
            )
            for f in dataclasses.fields(klass)
        }
        for key, value in kwargs.items():
            if key not in owners:
                raise ValueError(f"{key}: unknown engine option; known: {sorted(owners)}")
            parts[owners[key]][key] = value
        return cls(
            model=ModelConfig(**parts["model"]),  # type: ignore[arg-type]
            cache=CacheConfig(**parts["cache"]),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**parts["scheduler"]),  # type: ignore[arg-type]
        )


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo, else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


def _positive_or_none(name: str, value: object) -> None:
    if value is not None:
        _positive_int(name, value)

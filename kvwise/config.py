"""Engine configuration: frozen dataclasses, validated on construction (ValueError naming the field).

``EngineConfig.from_kwargs(**kw)`` is how the offline API and the CLI build one from flat
keywords such as ``block_size=16, kv_cache_memory="2GiB", max_num_seqs=16``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import string
from dataclasses import dataclass, field
from pathlib import Path

from kvwise.core.breakpoints import BreakpointPolicy
from kvwise.core.kv_spec import default_block_size, kv_format, kv_formats
from kvwise.core.scheduler_config import SchedulerConfig
from kvwise.machine import (
    DEFAULT_DISK_BYTES,
    available_memory_bytes,
    default_disk_size,
    dir_owner,
    free_directory,
    kvwise_cache_dir,
)
from kvwise.utils import check_positive_int, check_positive_or_none, parse_bytes, parse_duration

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "GrammarConfig",
    "ModelConfig",
    "SchedulerConfig",  # defined in the core, beside the scheduler that reads it
    "StoreConfig",
    "check_secret_strength",
]

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    dtype: str = "float32"  # the compute dtype of weights and activations
    # "auto": a quantized GGUF on quantized kernels, an HF checkpoint in `dtype`; "none":
    # every weight dequantized to `dtype` (the reference); "int8" / "int4": quantize at load
    quantization: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # a Jinja chat template that replaces (or supplies) the model's: a file's path, or the
    # template itself when the text holds "{%" or "{{"; None: the model's own
    chat_template: str | None = None
    # where the weights and the KV pool live ("cpu", or a torch device such as "cuda:0";
    # "meta" builds the engine with no memory): worker/device.py says what runs elsewhere
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.model is not None:
            if not isinstance(self.model, (str, Path)):
                raise ValueError(f"model: expected a path, got {self.model!r}")
            object.__setattr__(self, "model", str(self.model))
            if not Path(self.model).exists():
                raise ValueError(f"model: path '{self.model}' does not exist")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: expected one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.quantization is None:
            object.__setattr__(self, "quantization", "none")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization: expected one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        check_positive_or_none("max_model_len", self.max_model_len)
        check_positive_or_none("num_threads", self.num_threads)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device: expected a device name such as 'cpu', got {self.device!r}")
        if self.device != "cpu" and self.quantization in ("int8", "int4"):
            raise ValueError(
                f"quantization: {self.quantization!r} runs on kvwise's CPU kernels only; "
                f"on device {self.device!r} use 'none' or 'auto' (float weights)"
            )
        if self.chat_template is not None:
            from kvwise.engine.chat_template import load_chat_template  # jinja2: only when used

            if isinstance(self.chat_template, Path):
                object.__setattr__(self, "chat_template", str(self.chat_template))
            load_chat_template(self.chat_template)  # ValueError naming chat_template


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = None  # None: 16 tokens, 32 for int4 KV (default_block_size)
    kv_cache_dtype: str = "auto"  # how the KV pool stores K/V; "auto": the model's dtype
    kv_int4_group_size: int = 0  # int4 KV: channels per scale group (0: 32)
    # bytes or "2GiB"; None: what the model and the scheduler's limits need, at most
    # kv_cache_memory_fraction of the RAM available (kvwise.machine.default_pool)
    kv_cache_memory: int | str | None = None
    kv_cache_memory_fraction: float = 0.2
    enable_kv_cache: bool = True  # False: recompute the whole prefix at every step
    enable_prefix_caching: bool = True
    # a model with sliding-window layers: one block table per attention kind, windowed
    # layers keep only their window (False: every layer keeps every token, llama.cpp's
    # --swa-full)
    hybrid_kv_cache: bool = True
    enable_kv_events: bool = False  # record KV events for cache-aware routers (take_kv_events)
    public_prefixes: tuple[str, ...] = ()  # texts whose KV every tenant may share
    public_system_prompts: tuple[str, ...] = ()  # the same, rendered as chat system messages
    public_prefix_min_tokens: int = 256  # public prefixes are shared in chunks of this size
    max_retained_fraction_per_tenant: float = 0.5  # share of the pool one tenant may keep
    # cache breakpoints (RequestOptions.cache_breakpoints, Anthropic's cache_control): one
    # covering fewer prompt tokens keeps nothing; every breakpoint TTL is multiplied by the
    # scale (tests shorten 5 minutes to seconds)
    cache_min_tokens: int = 1024
    cache_ttl_scale: float = 1.0

    def __post_init__(self) -> None:
        formats = kv_formats()
        if self.kv_cache_dtype not in ("auto", *formats):
            raise ValueError(
                f"kv_cache_dtype: expected 'auto' or one of {formats}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.kv_cache_dtype))
        check_positive_int("block_size", self.block_size)
        if self.kv_int4_group_size and (
            self.kv_cache_dtype == "auto" or not kv_format(self.kv_cache_dtype).grouped
        ):
            raise ValueError("kv_int4_group_size: only for a grouped kv_cache_dtype ('int4')")
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
        check_positive_int("public_prefix_min_tokens", self.public_prefix_min_tokens)
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
        BreakpointPolicy(self.cache_min_tokens, self.cache_ttl_scale)  # ValueError naming them
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                "kv_cache_memory_fraction: must be in (0, 0.95], "
                f"got {self.kv_cache_memory_fraction}"
            )

    def kv_cache_bytes(self) -> int:
        """The KV pool's byte budget when given, else its cap: ``kv_cache_memory_fraction`` of
        the available memory (the engine sizes the default pool with ``machine.default_pool``,
        which needs the model's KV layout)."""
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        return int(available_memory_bytes() * self.kv_cache_memory_fraction)


LOAD_POLICIES = ("auto", "always", "never")

# the store secret rule (check_secret_strength); the CLI and the store factory apply it too
MIN_SECRET_CHARS = 32
MIN_HEX_SECRET_CHARS = 64  # 32 bytes
MIN_SECRET_DISTINCT_CHARS = 10


def check_secret_strength(secret: str, source: str = "kv_store_secret") -> None:
    """ValueError (naming ``source``, never echoing the secret) unless ``secret`` has at least
    32 characters, at least 10 of them different, and at least 64 if all are hex digits.

    One sealed entry lets anyone who can read a tier test guesses offline, so a secret must be
    out of reach of a search: ``kvwise secret`` prints one (``secrets.token_hex(32)``), as
    does ``openssl rand -hex 32``. The rule cannot measure entropy; it refuses the short and
    the obviously repetitive.
    """
    is_hex = all(c in string.hexdigits for c in secret)
    minimum = MIN_HEX_SECRET_CHARS if is_hex else MIN_SECRET_CHARS
    if len(secret) < minimum or len(set(secret)) < MIN_SECRET_DISTINCT_CHARS:
        raise ValueError(
            f"{source}: too weak to resist an offline search: a store secret needs at least "
            f"{MIN_SECRET_CHARS} characters, {MIN_SECRET_DISTINCT_CHARS} of them different, "
            f"and {MIN_HEX_SECRET_CHARS} if it is all hex digits (32 bytes); make one with "
            "'kvwise secret' or 'openssl rand -hex 32'"
        )


def _lock_name() -> str:
    from kvwise.store.disk_files import LOCK_NAME  # the disk tier's own (the store imports us)

    return LOCK_NAME


def default_kv_disk_path(name: str = "local") -> str | None:
    """The default disk tier directory of an engine named ``name`` (a server: its port):
    ``$XDG_CACHE_HOME/kvwise/kv-<name>`` (``~/.cache/kvwise`` without it), or the first of
    ``kv-<name>-2`` ... ``kv-<name>-8`` no running engine holds; None when all are held."""
    return free_directory(name, _lock_name())


def check_kv_disk_path_free(path: str | None) -> None:
    """ValueError naming ``kv_disk_path`` when a running engine holds the directory ``path``
    (the disk tier would refuse it after the model has loaded)."""
    owner = dir_owner(path, _lock_name()) if path else None
    if owner is not None:
        raise ValueError(
            f"kv_disk_path: {path} is in use by another kvwise engine (pid {owner}); give each "
            "engine a directory of its own (or leave --kv-disk-path out: each server then "
            f"gets one per port under {kvwise_cache_dir()})"
        )


@dataclass(frozen=True)
class StoreConfig:
    """The tiers below the device pool. Sizes: bytes or "4GiB"; "off" (or 0) disables a tier."""

    kv_host_memory: int | str | None = "2GiB"  # host-RAM tier budget
    # None: default_kv_disk_path(kv_disk_default_name), a directory per server; "off": none
    kv_disk_path: str | None = None
    kv_disk_default_name: str = "local"  # the default directory's name: kv-<this> (a port)
    kv_disk_size: int | str | None = None  # None: min(20GiB, half the free space there)
    # redis:// or rediss:// URL (password allowed), redis+cluster:// for Redis Cluster; None: off
    kv_redis_url: str | None = None
    kv_redis_ttl: str | float = "1h"  # how long Redis keeps an entry (retention may extend it)
    kv_redis_timeout: str | float = 0.5  # seconds before a Redis call counts as a fault
    kv_chunk_blocks: int = 8  # blocks per stored chunk (measured: see docs/BENCHMARKS.md)
    kv_layer_groups: int = 1  # entries per chunk, by layers: loads stream group by group
    kv_store_min_tokens: int = 64  # sequences shorter than this are not written to the tiers
    kv_load_policy: str = "auto"  # auto: the cost model decides; always / never (benchmarks)
    # the share of the host and the disk tier one tenant's kept (retention) entries may take
    kv_max_kept_fraction_per_tenant: float = 0.5
    # entry keys are HMACs under this secret (None: $KVWISE_KV_SECRET; without either, a disk
    # tier makes one beside its entries, and a Redis tier is refused unless the next is set)
    kv_store_secret: str | None = field(default=None, repr=False)
    kv_redis_allow_no_secret: bool = False  # share Redis with predictable keys (warned)
    # how the disk tier's path and budget were chosen (the start-up log), set on construction
    kv_disk_how: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kv_store_secret is not None:
            if not isinstance(self.kv_store_secret, str):
                raise ValueError("kv_store_secret: expected a string")  # NOTE: never echo it
            check_secret_strength(self.kv_store_secret)
        host = self.kv_host_memory
        host = 0 if host in (None, "off", 0) else parse_bytes(host, "kv_host_memory")
        object.__setattr__(self, "kv_host_memory", host)
        self._resolve_disk_tier()
        url = self.kv_redis_url
        if url in ("", "off"):
            url = None
        if url is not None and (
            not isinstance(url, str)
            or not url.startswith(
                ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
            )
        ):
            # NOTE: the URL may hold a password: never echo it
            raise ValueError(
                "kv_redis_url: expected redis://[:password@]host:port[/db] "
                "(or redis+cluster://[:password@]host:port for Redis Cluster)"
            )
        object.__setattr__(self, "kv_redis_url", url)
        object.__setattr__(self, "kv_redis_ttl", parse_duration(self.kv_redis_ttl, "kv_redis_ttl"))
        object.__setattr__(
            self, "kv_redis_timeout", parse_duration(self.kv_redis_timeout, "kv_redis_timeout")
        )
        check_positive_int("kv_chunk_blocks", self.kv_chunk_blocks)
        check_positive_int("kv_layer_groups", self.kv_layer_groups)
        check_positive_int("kv_store_min_tokens", self.kv_store_min_tokens)
        fraction = self.kv_max_kept_fraction_per_tenant
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not (0 <= fraction <= 1)
        ):
            raise ValueError(
                f"kv_max_kept_fraction_per_tenant: expected a number in [0, 1], got {fraction!r}"
            )
        if self.kv_load_policy not in LOAD_POLICIES:
            raise ValueError(
                f"kv_load_policy: expected one of {LOAD_POLICIES}, got {self.kv_load_policy!r}"
            )

    def _resolve_disk_tier(self) -> None:
        """The disk tier's directory (None: off) and budget, defaults resolved, and how."""
        path, how = self.kv_disk_path, "given"
        if path is not None and not isinstance(path, (str, Path)):
            raise ValueError(f"kv_disk_path: expected a directory or 'off', got {path!r}")
        name = self.kv_disk_default_name
        if not isinstance(name, str) or not name or os.sep in name or name.startswith("."):
            raise ValueError(f"kv_disk_default_name: expected a plain name, got {name!r}")
        if path is None:
            path = default_kv_disk_path(name)
            how = f"this server's own, port {name}" if name.isdigit() else f"the default, {name}"
            if path is not None and os.path.basename(path) != f"kv-{name}":
                how += f"; kv-{name} is in use by another kvwise engine"
            if path is None:
                logging.getLogger("kvwise").warning(
                    "KV disk tier off: every default directory kv-%s* under %s is in use by "
                    "another kvwise engine (give one with --kv-disk-path)",
                    name,
                    kvwise_cache_dir(),
                )
                path = "off"
        path = str(path)
        object.__setattr__(self, "kv_disk_path", None if path == "off" else path)
        size = self.kv_disk_size
        if size is None and path == "off":
            size = DEFAULT_DISK_BYTES
        elif size is None:
            chosen = default_disk_size(path)
            size, how = chosen.num_bytes, f"{how}; its budget {chosen.how}"
        object.__setattr__(self, "kv_disk_size", parse_bytes(size, "kv_disk_size"))
        object.__setattr__(self, "kv_disk_how", how)


@dataclass(frozen=True)
class GrammarConfig:
    """How structured outputs' constraints are compiled (``engine/grammar_compiler.py``)."""

    # a constraint not compiled within this many seconds is a 400 naming its field
    grammar_compile_timeout_s: float = 5.0
    # worker processes for first compiles (a deadline kills one); 0: compile in the calling
    # thread with no deadline (trusted offline use)
    grammar_workers: int = 2
    grammar_compiles_per_tenant: int = 1  # compiles of one tenant at once
    grammar_cache_entries: int = 256  # compiled constraints kept, by tenant and text

    def __post_init__(self) -> None:
        timeout_s = self.grammar_compile_timeout_s
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
            raise ValueError(f"grammar_compile_timeout_s: expected (0, 3600], got {timeout_s!r}")
        for name in ("grammar_workers", "grammar_compiles_per_tenant", "grammar_cache_entries"):
            value = getattr(self, name)
            low = 0 if name in ("grammar_workers", "grammar_cache_entries") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from flat keywords; an unknown keyword is a ValueError naming it."""
        parts: dict[str, dict[str, object]] = {
            "model": {},
            "cache": {},
            "scheduler": {},
            "store": {},
            "grammar": {},
        }
        owners = {
            f.name: part
            for part, klass in (
                ("model", ModelConfig),
                ("cache", CacheConfig),
                ("scheduler", SchedulerConfig),
                ("store", StoreConfig),
                ("grammar", GrammarConfig),
            )
            for f in dataclasses.fields(klass)
            if f.init
        }
        for key, value in kwargs.items():
            if key not in owners:
                raise ValueError(f"{key}: unknown engine option; known: {sorted(owners)}")
            parts[owners[key]][key] = value
        return cls(
            model=ModelConfig(**parts["model"]),  # type: ignore[arg-type]
            cache=CacheConfig(**parts["cache"]),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**parts["scheduler"]),  # type: ignore[arg-type]
            store=StoreConfig(**parts["store"]),  # type: ignore[arg-type]
            grammar=GrammarConfig(**parts["grammar"]),  # type: ignore[arg-type]
        )

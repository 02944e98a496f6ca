"""``build_engine(config)``: load the model and tokenizer, size the KV pool, and assemble an
``LLMEngine`` from its parts (``assemble.py``). The composition root of the real engine.
``build_model_parts`` stops before the assembly, so a caller (a test) can put its own wrapper
around the model runner."""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass

import torch

from kvwise.config import EngineConfig, check_kv_disk_path_free
from kvwise.core.kv_spec import KVSpec, kv_groups
from kvwise.engine.assemble import assemble_engine
from kvwise.engine.chat_template import load_chat_template
from kvwise.engine.llm_engine import LLMEngine
from kvwise.engine.tokenizer import Tokenizer
from kvwise.machine import (
    PoolSize,
    available_memory_bytes,
    check_pool_fits,
    default_pool,
    model_file_bytes,
)
from kvwise.models.loader import LoadedModel, load_model
from kvwise.utils import format_bytes
from kvwise.worker.device import is_host, resolve_device
from kvwise.worker.kv_cache import TORCH_DTYPES
from kvwise.worker.model_runner import ModelRunner

logger = logging.getLogger("kvwise")


def load_for(config: EngineConfig, progress: bool = True) -> LoadedModel:
    """The weights ``config`` names, in its compute dtype, on its device (share them across
    engines with ``build_engine(..., loaded=)``)."""
    return load_model(
        config.model.model,
        dtype=TORCH_DTYPES[config.model.dtype],
        progress=progress,
        quantization=config.model.quantization,
        device=resolve_device(config.model.device),
    )


@dataclass(frozen=True)
class ModelParts:
    """What a loaded model contributes to an engine; ``assemble_engine`` adds the rest."""

    runner: ModelRunner
    tokenizer: Tokenizer
    model_fingerprint: str  # the weights and the compute dtype
    max_model_len: int

    def assemble(self, config: EngineConfig, runner=None) -> LLMEngine:
        """The engine around these parts; ``runner`` replaces the model runner (e.g. a test's
        wrapper around it)."""
        return assemble_engine(
            config,
            runner or self.runner,
            self.tokenizer,
            model_fingerprint=self.model_fingerprint,
            max_model_len=self.max_model_len,
        )


def build_model_parts(
    config: EngineConfig, *, progress: bool = True, loaded: LoadedModel | None = None
) -> ModelParts:
    """Load the model (unless ``loaded`` reuses weights already in memory) and its tokenizer,
    and size the KV pool: a ``ModelRunner`` over a ``KVSpec``.

    Raises:
        ValueError: before the model loads, a ``kv_cache_memory`` that cannot fit beside its
            weights (their files' size) or a ``kv_disk_path`` another engine holds; after, a
            pool that cannot fit beside what the weights hold, or under two blocks.
    """
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    available = available_memory_bytes()  # NOTE: before these weights take their share
    shared = loaded is not None  # weights in memory already: not in `available`
    device = check_before_load(config, available, estimate_weights=not shared)
    loaded = loaded or load_for(config, progress)
    logger.info(
        "weights: %s; %s resident",
        _WEIGHT_FORMATS.get(loaded.weight_format, config.model.dtype),
        format_bytes(loaded.model.weight_bytes()),
    )
    for row in loaded.weight_report:  # quantization="auto" on a GGUF: each type as it runs
        logger.info(
            "weights: %d %s tensors as %s, %s",
            row.tensors,
            row.gguf_type,
            row.runs_as,
            format_bytes(row.resident_bytes),
        )
    arch = loaded.arch
    tokenizer = tokenizer_for(loaded)
    if config.model.chat_template is not None:
        tokenizer.set_chat_template(load_chat_template(config.model.chat_template))
        logger.info("chat template: %s", _template_name(config.model.chat_template))
    spec = _kv_spec(config, loaded)
    max_model_len = _max_model_len(config, arch)
    if config.cache.kv_cache_memory is not None and not shared and is_host(device):
        check_pool_fits(
            config.cache.kv_cache_memory, available, loaded.model.weight_bytes(), estimated=False
        )
    pool = _pool_size(config, spec, max_model_len)
    num_blocks = spec.num_blocks_in(pool.num_bytes)
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory: {format_bytes(pool.num_bytes)} holds fewer than "
            f"two blocks of {format_bytes(spec.block_bytes)}"
        )
    _log_sizes(config, format_bytes(num_blocks * spec.block_bytes), pool.how)
    compute_dtype = TORCH_DTYPES[config.model.dtype]
    # another device computes other bits (torch's kernels, not kvwise's): other KV
    where = "" if is_host(device) else f"/{device.type}"
    return ModelParts(
        runner=ModelRunner(loaded.model, arch, spec, num_blocks, compute_dtype, device),
        tokenizer=tokenizer,
        model_fingerprint=f"{loaded.fingerprint}/{config.model.dtype}{where}",
        max_model_len=max_model_len,
    )


def check_before_load(config: EngineConfig, available: int, estimate_weights: bool) -> torch.device:
    """What can fail before the model loads: a device this machine lacks (or one other than
    the CPU with no ``kv_cache_memory``), a ``kv_cache_memory`` that cannot fit beside the
    weights (``estimate_weights``: by their files' size; else they are in memory already), a
    disk tier directory another engine holds. ValueError naming the option. Returns the
    device."""
    device = resolve_device(config.model.device)
    if not is_host(device) and config.cache.kv_cache_memory is None:
        raise ValueError(
            f"kv_cache_memory: give the KV pool's size on device {device} (the default is "
            "sized from the host's RAM)"
        )
    if config.cache.kv_cache_memory is not None and is_host(device):
        weights = model_file_bytes(_model_path(config)) if estimate_weights else 0
        check_pool_fits(config.cache.kv_cache_memory, available, weights, estimated=True)
    check_kv_disk_path_free(config.store.kv_disk_path)
    return device


def _model_path(config: EngineConfig) -> str:
    if config.model.model is not None:
        return config.model.model
    from kvwise.models.default import default_model_path

    return str(default_model_path())


def _template_name(template: str) -> str:
    return "given inline" if "{%" in template or "{{" in template else f"from '{template}'"


def _kv_spec(config: EngineConfig, loaded: LoadedModel) -> KVSpec:
    """The pool's layout: the model's KV shape, the configured block size and format, and its
    KV groups (a model with sliding-window layers, ``hybrid_kv_cache`` on)."""
    arch = loaded.arch
    kv_dtype = config.cache.kv_cache_dtype
    kinds = getattr(loaded.model, "attention_kinds", ())
    groups = ()
    if config.cache.hybrid_kv_cache and kinds:
        groups = kv_groups([k.sliding_window or 0 for k in kinds])
    return KVSpec(
        len(groups[0].layers) if groups else arch.num_layers,
        arch.num_kv_heads,
        arch.head_dim,
        config.cache.block_size,
        config.model.dtype if kv_dtype == "auto" else kv_dtype,
        group_size=config.cache.kv_int4_group_size,
        groups=groups,
    )


def _pool_size(config: EngineConfig, spec: KVSpec, max_model_len: int) -> PoolSize:
    """The pool's bytes: ``kv_cache_memory``, else what the scheduler's limits need
    (``machine.default_pool``), at most ``kv_cache_memory_fraction`` of the RAM available now
    (the weights loaded)."""
    if config.cache.kv_cache_memory is not None:
        return PoolSize(int(config.cache.kv_cache_memory), "--kv-cache-memory")
    return default_pool(
        spec.seq_bytes,
        config.scheduler.max_num_seqs,
        max_model_len,
        available_memory_bytes(),
        config.cache.kv_cache_memory_fraction,
    )


_WEIGHT_FORMATS = {
    "gguf": "every GGUF tensor at its own type's precision (per type below), norms float32, "
    "activations into the block kernels int8 per block of 32",
    "int4": "linear layers int4 (blocks of 32, float16 scale and minimum; GGUF Q4_0/Q4_1 as "
    "they are), embedding and LM head int8 in blocks of 32 (GGUF Q8_0 as it is), norms "
    "float32, activations into the kernels int8 per block of 32",
    "int8": "linear layers int8 per output channel (activations into torch's kernel bfloat16), "
    "embedding and LM head int8 in blocks of 32 (activations int8 per block of 32), norms "
    "float32",
}


def build_engine(
    config: EngineConfig | None = None, *, progress: bool = True, loaded: LoadedModel | None = None
) -> LLMEngine:
    """Load the model, size the KV pool and assemble the engine."""
    config = config or EngineConfig()
    return build_model_parts(config, progress=progress, loaded=loaded).assemble(config)


def build_engine_for_loop(config: EngineConfig | None = None, **kwargs) -> LLMEngine:
    """`build_engine` in a thread of its own that ends with the load, for an engine another
    thread will step (`AsyncEngine`'s loop): the OpenMP workers the load starts leave with that
    thread, so the loop's thread holds the process's only OpenMP team. Two teams on two cores
    make libgomp count more threads than cores, and its workers then sleep at every barrier
    instead of spinning: each of a step's ~200 parallel regions waits for a wake-up (a cached
    2,048-token prompt's one-row step: 13 ms stepped where it was built, 22 ms in another
    thread, measured here)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvwise-load") as pool:
        return pool.submit(build_engine, config, **kwargs).result()


def _log_sizes(config: EngineConfig, pool_size: str, pool_how: str) -> None:
    """The start-up lines that say what the KV pool and the disk tier got, and why."""
    logger.info(
        "KV pool: %s for %s (its pages are taken as blocks are first used)", pool_size, pool_how
    )
    store = config.store
    if store.kv_disk_path is not None:
        logger.info(
            "KV disk tier: %s, %s: %s",
            store.kv_disk_path,
            format_bytes(store.kv_disk_size),
            store.kv_disk_how,
        )


def tokenizer_for(loaded: LoadedModel) -> Tokenizer:
    """The model's own tokenizer: from the GGUF it was loaded from (already open), or from the
    HF directory."""
    if loaded.gguf_reader is not None:
        return Tokenizer.from_gguf(loaded.gguf_reader)
    return Tokenizer.from_path(loaded.source)


def _max_model_len(config: EngineConfig, arch) -> int:
    max_model_len = config.model.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's context of "
            f"{arch.max_position_embeddings}"
        )
    return max_model_len

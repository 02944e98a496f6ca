"""Assemble an engine around a model runner (any ``core.runner.ModelRunner``) and a tokenizer:
the KV cache manager, the scheduler, the tiered store and the output processor (detokenizer),
from an ``EngineConfig``. No torch here: tests assemble a whole engine around the
``FakeModelRunner`` and a byte tokenizer with this; ``builder.build_engine`` loads a real model
and calls it."""

from __future__ import annotations

import logging

from kvwise.config import EngineConfig
from kvwise.core.breakpoints import BreakpointPolicy
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.runner import ModelRunner
from kvwise.core.scheduler import Scheduler
from kvwise.engine.llm_engine import LLMEngine
from kvwise.engine.output_processor import OutputProcessor
from kvwise.engine.prompts import Tokenizer
from kvwise.perf.sizing import hybrid_summary
from kvwise.store.factory import build_store
from kvwise.utils import format_bytes

logger = logging.getLogger("kvwise")


def _log_pool(runner: ModelRunner) -> None:
    """The start-up line of the pool (and of a hybrid cache's groups)."""
    spec = runner.spec
    logger.info(
        "KV cache: %s in %d blocks of %d tokens = %d tokens (%s per token%s, %s)",
        format_bytes(runner.num_blocks * spec.block_bytes),
        runner.num_blocks,
        spec.block_size,
        runner.num_blocks * spec.block_size,
        format_bytes(spec.bytes_per_token),
        f" in one group of {spec.num_layers} layers" if spec.groups else "",
        spec.dtype_tag,
    )
    if spec.groups:
        logger.info("KV cache: %s", hybrid_summary(spec))


def assemble_engine(
    config: EngineConfig,
    runner: ModelRunner,
    tokenizer: Tokenizer,
    *,
    model_fingerprint: str,
    max_model_len: int,
) -> LLMEngine:
    """Build the parts around ``runner`` (whose ``spec`` and ``num_blocks`` size the pool).

    Args:
        model_fingerprint: names the weights and compute dtype; the KV layout is appended, and
            the result roots every block hash and stamps every stored entry.
        max_model_len: the longest sequence a request may reach.
    """
    cache, spec = config.cache, runner.spec
    fingerprint = f"{model_fingerprint}/{spec.layout}"
    public = [tokenizer.encode(p) for p in cache.public_prefixes] + [
        tokenizer.encode_chat([{"role": "system", "content": p}], add_generation_prompt=False)
        for p in cache.public_system_prompts
    ]
    kv_manager = KVCacheManager(
        runner.num_blocks,
        spec.block_size,
        enable_caching=cache.enable_prefix_caching and cache.enable_kv_cache,
        model_fingerprint=fingerprint,
        public_prefixes=public,
        public_min_tokens=cache.public_prefix_min_tokens,
        max_retained_blocks_per_tenant=int(
            runner.num_blocks * cache.max_retained_fraction_per_tenant
        ),
        kv_events=cache.enable_kv_events,
        windows=[g.window for g in spec.kv_groups],
        whole_hits=runner.skips_cached_writes,
        breakpoints=BreakpointPolicy(cache.cache_min_tokens, cache.cache_ttl_scale),
    )
    store = None
    if kv_manager.enable_caching:
        prefill_chunk_size = config.scheduler.prefill_chunk_size
        store = build_store(config.store, spec, fingerprint, prefill_chunk_size)
        if store is not None and cache.enable_kv_events:
            store.record_events()  # the tiers' blocks join the pool's in take_kv_events
    scheduler = Scheduler(
        config.scheduler, kv_manager, max_model_len, cache.enable_kv_cache, tiers=store
    )
    _log_pool(runner)
    return LLMEngine(
        runner=runner,
        tokenizer=tokenizer,
        kv_manager=kv_manager,
        scheduler=scheduler,
        outputs=OutputProcessor(tokenizer, runner.num_layers),
        store=store,
        max_model_len=max_model_len,
        grammar=config.grammar,
    )

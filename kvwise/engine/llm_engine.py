"""The synchronous engine: add requests, ``step()`` them, get outputs.

One step = schedule → copy stored prefixes in → worker executes → scheduler updates → copy
finished requests' blocks out for the tiers → detokenize and check stop strings. The engine
is the only place that joins the tokenizer (text) with the core (token ids), and the core's
plain store decisions with the worker's tensors.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvwise.config import EngineConfig
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.request import Request
from kvwise.core.scheduler import Scheduler
from kvwise.engine.detokenize import IncrementalDetokenizer, StopStringMatcher
from kvwise.engine.kv_loader import KVLoader
from kvwise.engine.store_factory import build_store
from kvwise.engine.tokenizer import Tokenizer
from kvwise.models.loader import LoadedModel, load_model
from kvwise.types import FinishReason, RequestMetrics, RequestOutput, SamplingParams
from kvwise.utils import format_bytes, parse_duration
from kvwise.worker.kv_cache import PagedKVCache
from kvwise.worker.model_runner import ModelRunner

logger = logging.getLogger("kvwise")

Prompt = str | list[dict] | list[int]

MAX_SESSIONS = 100_000  # sessions remembered for park(); the least recently used go first

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _RequestState:
    """Engine-side state of one request: text assembly and timing."""

    request: Request
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    metrics: RequestMetrics
    session_id: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        progress: bool = True,
        loaded: LoadedModel | None = None,
    ) -> None:
        """Load the model and size the KV pool. ``loaded`` reuses weights already in memory
        (tests and benchmarks build several engines over one model)."""
        self.config = config = config or EngineConfig()
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        self.dtype = _DTYPES[config.model.dtype]
        if loaded is None:
            loaded = load_model(config.model.model, dtype=self.dtype, progress=progress)
        self.loaded = loaded
        self.arch = arch = loaded.arch
        if loaded.gguf_reader is not None:
            self.tokenizer = Tokenizer.from_gguf(loaded.gguf_reader)
        else:
            self.tokenizer = Tokenizer.from_path(loaded.source)
        self.max_model_len = config.model.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's context of "
                f"{arch.max_position_embeddings}"
            )
        if arch.sliding_window and self.max_model_len > arch.sliding_window:
            # NOTE: attention has no sliding window; within the window full attention is exact.
            logger.warning(
                "max_model_len capped at the model's sliding window of %d", arch.sliding_window
            )
            self.max_model_len = arch.sliding_window
        cache = config.cache
        block_bytes = PagedKVCache.bytes_per_block(
            arch.num_layers, cache.block_size, arch.num_kv_heads, arch.head_dim, self.dtype
        )
        num_blocks = cache.kv_cache_bytes() // block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory: {format_bytes(cache.kv_cache_bytes())} holds fewer than two "
                f"blocks of {format_bytes(block_bytes)}"
            )
        # NOTE: the fingerprint is the root of every block hash: weights, dtype and KV layout.
        kv_layout = f"L{arch.num_layers}.KV{arch.num_kv_heads}.D{arch.head_dim}.B{cache.block_size}"
        self.kv_manager = KVCacheManager(
            num_blocks,
            cache.block_size,
            enable_caching=cache.enable_prefix_caching and cache.enable_kv_cache,
            model_fingerprint=f"{loaded.fingerprint}/{config.model.dtype}/{kv_layout}",
            public_prefixes=[self.tokenizer.encode(p) for p in cache.public_prefixes]
            + [
                self.tokenizer.encode_chat(
                    [{"role": "system", "content": p}], add_generation_prompt=False
                )
                for p in cache.public_system_prompts
            ],
            public_min_tokens=cache.public_prefix_min_tokens,
            max_retained_blocks_per_tenant=int(num_blocks * cache.max_retained_fraction_per_tenant),
        )
        self.store = None
        if self.kv_manager.enable_caching and config.store.any_tier:
            self.store = build_store(
                config.store,
                self.kv_manager.model_fingerprint,
                config.model.dtype,
                arch,
                cache.block_size,
                config.scheduler.prefill_chunk_size,
            )
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_manager,
            self.max_model_len,
            cache.enable_kv_cache,
            store=self.store,
        )
        self.runner = ModelRunner(loaded.model, arch, num_blocks, cache.block_size, self.dtype)
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %s in %d blocks of %d tokens = %d tokens (%s per token)",
            format_bytes(num_blocks * block_bytes),
            num_blocks,
            cache.block_size,
            num_blocks * cache.block_size,
            format_bytes(block_bytes / cache.block_size),
        )
        self._states: dict[str, _RequestState] = {}
        self._next_id = 0
        # (tenant, session id) -> chain hashes of the session's last finished turn, LRU-capped
        self._sessions: OrderedDict[tuple[str, str], list[bytes]] = OrderedDict()
        self._closed = False

    # ---- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A string, a chat message list or token ids → token ids (ValueError on bad input)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.encode_chat(prompt)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = self.arch.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt: token ids must be in [0, {vocab}), got {bad[:5]}")
            return list(prompt)
        raise ValueError(
            "prompt: expected a non-empty string, a list of chat messages or a list of token ids"
        )

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tenant: str = "default",
        cache_salt: str | None = None,
        retention: str | float | None = None,
        session_id: str | None = None,
    ) -> str:
        """Queue a prompt. ``retention`` ("1h", seconds, or None for the default LRU) asks to
        keep the request's cached prefix; kept blocks are evicted after all others (and kept
        that long in the disk and Redis tiers). ``session_id`` names the conversation, so that
        ``park(session_id)`` can move its KV down to the tiers between turns."""
        params = params or SamplingParams()
        retention_s = (
            None if retention in (None, "default") else parse_duration(retention, "retention")
        )
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt: must be a string")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("tenant: must be a non-empty string")
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise ValueError("session_id: must be a non-empty string")
        if self._closed:
            raise RuntimeError("the engine is closed")
        token_ids = self.tokenize(prompt)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        now = time.perf_counter()
        request = Request(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            tenant=tenant,
            cache_salt=cache_salt,
            arrival_time=now,
            retention_s=retention_s,
        )
        self.scheduler.add_request(request)
        self._states[request_id] = _RequestState(
            request=request,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stop_matcher=StopStringMatcher(params.stop) if params.stop else None,
            metrics=RequestMetrics(arrival_time=now),
            session_id=session_id,
        )
        return request_id

    def abort(self, request_ids: list[str]) -> None:
        """Cancel requests; their blocks are freed at once."""
        self.scheduler.finish_requests(list(request_ids), FinishReason.ABORT)
        self._save_blocks()
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        self._save_blocks()  # of requests preempted just now, before their blocks are reused
        loader = (
            KVLoader(self.store, self.runner, sched_out.kv_loads) if sched_out.kv_loads else None
        )
        t0 = time.perf_counter()
        try:
            if loader is None:
                model_out = self.runner.execute(sched_out)
            else:
                model_out = self.runner.execute(sched_out, layer_ready=loader.wait_layer)
        finally:
            if loader is not None:
                loaded, short = loader.finish()
        elapsed = time.perf_counter() - t0
        if loader is not None:
            model_out.short_loads = short
            self.store.count_loaded(sum(loaded.values()))
            elapsed -= loader.waited  # the model's own time: what recomputing would cost
        if self.store is not None and sched_out.scheduled:
            chunks = [(s.start_pos, s.num_tokens) for s in sched_out.scheduled]
            self.store.cost.observe_step(chunks, elapsed)
        updates = self.scheduler.update(sched_out, model_out)
        now = time.perf_counter()
        outputs = []
        stopped: list[str] = []
        for update in updates:
            request = update.request
            state = self._states.get(request.request_id)
            if state is None:
                continue
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
            delta_text = ""
            finished = update.finished
            for token_id in update.new_token_ids:
                state.token_ids.append(token_id)
                state.metrics.token_times.append(now)
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                delta_text += state.detokenizer.add(token_id)
            if finished:
                delta_text += state.detokenizer.flush()
            if state.stop_matcher is not None:
                check = state.stop_matcher.feed(delta_text)
                delta_text = check.text
                if check.stopped and not finished:
                    finished = True
                    stopped.append(request.request_id)
                    request.finish_reason = FinishReason.STOP
                elif finished:
                    delta_text += state.stop_matcher.flush()
            state.text += delta_text
            if finished:
                state.metrics.finished_time = now
                self._states.pop(request.request_id)
                if state.session_id is not None:
                    num_full = request.num_computed_tokens // self.kv_manager.block_size
                    key = (request.tenant, state.session_id)
                    self._sessions[key] = list(request.block_hashes[:num_full])
                    self._sessions.move_to_end(key)
                    if len(self._sessions) > MAX_SESSIONS:
                        self._sessions.popitem(last=False)
            outputs.append(self._output(state, delta_text, update.new_token_ids, finished))
        if stopped:
            self.scheduler.finish_requests(stopped, FinishReason.STOP)
        self._save_blocks()  # of requests that finished in this step
        return outputs

    def _save_blocks(self) -> None:
        """Copy the blocks the scheduler queued for the tiers out of the pool (a memory copy
        here; packing and I/O run on the store's writer thread)."""
        for save in self.scheduler.take_saves():
            self.store.write(save.chunk, self.runner.save_kv(save.block_ids), save.ttl_s)

    def _output(
        self, state: _RequestState, delta_text: str, delta_ids: list[int], finished: bool
    ) -> RequestOutput:
        request = state.request
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.token_ids[: request.num_prompt_tokens],
            text=state.text,
            token_ids=list(state.token_ids),
            logprobs=list(request.output_logprobs),
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_loaded_tokens=request.num_loaded_tokens,
            num_kv_rows_projected=request.num_tokens_projected * self.arch.num_layers,
            metrics=state.metrics,
            delta_text=delta_text,
            delta_token_ids=list(delta_ids),
        )

    # ---- introspection ------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        pool = self.kv_manager.pool
        queries = self.kv_manager.num_prefix_query_tokens
        hits = self.kv_manager.num_prefix_hit_tokens
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "kv_blocks_cached_free": pool.num_cached_free_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "prefix_query_tokens": queries,
            "prefix_hit_tokens": hits,
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "kv_blocks_kept": sum(pool.num_retained.values()),
            "kv_utilization": self.kv_manager.kv_utilization(self.scheduler.running),
            **self.store_stats(),
        }

    def store_stats(self) -> dict[str, float | int]:
        """Per-tier counters (``kv_tier_<tier>_<counter>``) and the store's decisions."""
        if self.store is None:
            return {}
        stats = self.store.stats()
        flat: dict[str, float | int] = {
            f"kv_tier_{tier}_{name}": value
            for tier, counters in stats.pop("tiers").items()
            for name, value in counters.items()
        }
        flat.update({f"kv_store_{name}": value for name, value in stats.items()})
        return flat

    def add_public_prefix(self, prompt: Prompt) -> int:
        """Declare a prefix every tenant may share (e.g. a system prompt); chat messages are
        rendered without a generation prompt. Returns its length in tokens."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            token_ids = self.tokenizer.encode_chat(prompt, add_generation_prompt=False)
        else:
            token_ids = self.tokenize(prompt)
        self.kv_manager.public_prefixes.append(token_ids)
        return len(token_ids)

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity()

    # ---- sessions and the tiers ---------------------------------------------------------

    def park(self, session_id: str, tenant: str = "default") -> int:
        """Move a conversation's KV out of the device pool, into the tiers, until its next
        turn (sent with the same ``session_id``) loads it back.

        Waits for its blocks to be written, then frees the device blocks that some tier now
        holds (blocks shared with running requests stay). Returns the number of tokens parked.
        """
        hashes = self._sessions.get((tenant, session_id))
        if hashes is None:
            raise ValueError(f"session_id: no finished turn of session {session_id!r}")
        busy = [s for s in self._states.values() if s.session_id == session_id]
        if any(s.request.tenant == tenant for s in busy):
            raise ValueError(f"session_id: session {session_id!r} has a request in flight")
        if self.store is None or not hashes:
            return 0
        self.store.flush()
        num_stored = self.store.num_stored_blocks(hashes, len(hashes))
        self.kv_manager.pool.drop_cached(hashes[:num_stored])
        return num_stored * self.kv_manager.block_size

    def flush(self) -> None:
        """Wait until every queued write has reached the tiers."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        """Flush pending writes to the tiers and release them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.store is not None:
            self.store.close()

"""The synchronous engine: add requests, ``step()`` them, get outputs.

One step = schedule → copy out the blocks of requests preempted just now → run the model while
the loader streams planned loads in → scheduler update (rolling back short loads) → text,
stop strings and outputs → copy out the blocks of requests that finished. The engine joins
parts it is given (``assemble.py`` and ``builder.py`` build them): a tokenizer (text ↔ ids),
the scheduler and KV cache manager (pure bookkeeping), a model runner (tensors, or the fake
runner in tests) and, optionally, the tiered store below the device pool.
"""

from __future__ import annotations

import logging
import time

from kvwise.config import GrammarConfig
from kvwise.core.admission import oldest_wait_s
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.kv_events import KVEvent
from kvwise.core.outputs import ModelOutput, SchedulerOutput
from kvwise.core.request import Request
from kvwise.core.runner import ModelRunner
from kvwise.core.scheduler import RequestUpdate, Scheduler
from kvwise.engine.grammar_compiler import GrammarCompiler
from kvwise.engine.kv_loader import KVLoader
from kvwise.engine.output_processor import OutputProcessor
from kvwise.engine.prompts import (
    Prompt,
    RecentAnswers,
    TokenizedPrompt,
    Tokenizer,
    tokenize_prompt,
)
from kvwise.engine.sessions import SessionMap
from kvwise.engine.stats import EngineStats, grammar_stats, tool_pause_stats
from kvwise.engine.stop_parts import GrammarStop, TextStop
from kvwise.engine.structured import Grammar
from kvwise.engine.tool_pauses import ToolPauses
from kvwise.errors import InvalidRequest, SessionBusy, SessionNotFound
from kvwise.store.tiered import TieredStore
from kvwise.types import FinishReason, RequestOptions, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        *,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        kv_manager: KVCacheManager,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        store: TieredStore | None = None,
        max_model_len: int,
        grammar: GrammarConfig | None = None,
    ) -> None:
        """Join the parts. ``runner`` follows the contract in ``core/runner.py``; ``outputs``
        turns the scheduler's token ids into text and ``RequestOutput``s; ``grammar``: how
        structured outputs' constraints are compiled."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.kv_manager = kv_manager
        self.scheduler = scheduler
        self.store = store
        self.max_model_len = max_model_len
        self._vocab_size = runner.vocab_size
        self.outputs = outputs
        self.sessions = SessionMap()
        self.grammars = GrammarCompiler(tokenizer, runner.vocab_size, grammar)
        self.answers = RecentAnswers()
        self.tool_pauses = ToolPauses()
        self.num_last_rows_reused = 0  # whole hits sampled from a kept last row
        self.num_generated_tokens = 0  # sampled, in every step so far
        self._next_id = 0
        self._closed = False

    # ---- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: Prompt, tenant: str = "default") -> list[int]:
        """A string, a chat message list or token ids → token ids (InvalidRequest on bad
        input). Safe to call from any thread (it reads the tokenizer and immutable sizes
        only): ``AsyncEngine`` tokenizes on its own threads and hands ``add_request`` a
        ``TokenizedPrompt``, so the step loop never renders or tokenizes."""
        return tokenize_prompt(
            self.tokenizer,
            prompt,
            self._vocab_size,
            self.max_model_len,
            self.answers.lookup(tenant),
        )

    def tokenized(self, prompt: Prompt, tenant: str = "default") -> TokenizedPrompt:
        """``tokenize`` as a prompt ``add_request`` takes without further work."""
        return TokenizedPrompt(tuple(self.tokenize(prompt, tenant)))

    def compile_grammar(self, params: SamplingParams, tenant: str = "default") -> Grammar | None:
        """The request's grammar (``params.structured``), compiled (``GrammarCompiler``: a
        deadline, a per-tenant cache); None without one. Safe from any thread: ``AsyncEngine``
        compiles on threads of its own, off the step loop."""
        if params.structured is None:
            return None
        return self.grammars.compile(params.structured, tenant)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        options: RequestOptions | None = None,
        request_id: str | None = None,
        grammar: Grammar | None = None,
    ) -> str:
        """Queue a prompt; ``options`` says how it uses the cache (tenant, salt, retention,
        session); ``grammar``: ``params.structured`` compiled already (else compiled here).
        Raises ``InvalidRequest`` (a ValueError naming the field) on bad input and
        ``QueueFullError`` when the bounded waiting queue is full."""
        params = params or SamplingParams()
        options = options or RequestOptions()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params", f"expected SamplingParams, got {type(params).__name__}")
        if not isinstance(options, RequestOptions):
            raise InvalidRequest(
                "options", f"expected RequestOptions, got {type(options).__name__}"
            )
        if self._closed:
            raise RuntimeError("the engine is closed")
        outside = [t for t, _ in params.logit_bias if t >= self._vocab_size]
        if outside:
            raise InvalidRequest(
                "logit_bias", f"token ids must be in [0, {self._vocab_size}), got {outside[:5]}"
            )
        token_ids = self.tokenize(prompt, options.tenant)
        if grammar is None:
            grammar = self.compile_grammar(params, options.tenant)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        now = time.perf_counter()
        request = Request(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            options=options,
            arrival_time=now,
        )
        request.grammar = grammar
        # its stop policy's parts beyond its token limits (core/stopping.py): its grammar,
        # then its text and stop strings (the text its outputs carry, too)
        text = TextStop(self.tokenizer, params.stop)
        request.stop_parts = [GrammarStop(grammar), text] if grammar is not None else [text]
        self.scheduler.add_request(request)
        self.outputs.add(request, now, text)
        return request_id

    def abort(self, request_ids: list[str]) -> None:
        """Cancel requests; their blocks are freed at once."""
        self.scheduler.finish_requests(list(request_ids), FinishReason.ABORT)
        self._save_blocks()
        self.outputs.drop(list(request_ids))

    def load_tokens(self) -> tuple[int, int]:
        """``(queued, running)`` tokens (``Scheduler.load_tokens``): a router's load figure."""
        return self.scheduler.load_tokens()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events (``core/kv_events.py``) since the last call: the device pool's
        (medium ``"device"``), then the host and disk tiers' (medium: the tier's name, by
        stored chunk); empty unless ``enable_kv_events`` is set."""
        events = self.kv_manager.take_kv_events()
        if self.store is not None:
            events += self.store.take_tier_events()
        return events

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.store is not None:
            self.store.engine_busy(True)  # its writer starts no job while the loop has work
        sched_out = self.scheduler.schedule()
        self._save_blocks()  # of requests preempted just now, before their blocks are reused
        failed: dict[str, str] = {}  # request id → why its row failed: it ends alone
        self._grammar_masks(sched_out, failed)
        model_out, short_loads = self._execute(sched_out)
        self.num_last_rows_reused += model_out.last_rows_reused
        failed.update(model_out.failed)
        failed_updates = self._fail_rows(failed)
        # every request's end is decided in here, once per sampled token (core/stopping.py)
        updates = self.scheduler.update(sched_out, model_out, short_loads)
        self.num_generated_tokens += sum(len(u.new_token_ids) for u in updates)
        processed = self.outputs.process(failed_updates + updates)
        if processed.failed:
            failed.update(processed.failed)
            self.scheduler.finish_requests(list(processed.failed), FinishReason.ERROR)
        for out in processed.outputs:
            if out.request_id in failed and out.finished:
                out.finish_reason, out.error = FinishReason.ERROR, failed[out.request_id]
        self._record_answers(processed)
        bs = self.kv_manager.block_size
        for update in updates:
            if update.new_token_ids and update.request.num_output_tokens == 1:
                self.tool_pauses.resumed(update.request, bs)  # a tool's result, if any
        for request in processed.finished:
            self.tool_pauses.finished(request, bs)
            if request.options.session_id is not None:
                num_full = request.num_computed_tokens // self.kv_manager.block_size
                self.sessions.record(
                    request.tenant, request.options.session_id, request.block_hashes[:num_full]
                )
        self._save_blocks()  # of requests that finished in this step
        if self.store is not None:
            self.store.engine_busy(self.has_unfinished())
        return processed.outputs

    def _record_answers(self, processed) -> None:
        """Finished answers' ids by their text (``RecentAnswers``), where the ids are that
        text exactly (not an answer a stop string cut short, say)."""
        finished = {r.request_id: r for r in processed.finished}
        for out in processed.outputs:
            request = finished.get(out.request_id)
            if request is None or out.finish_reason is FinishReason.ABORT or not out.text:
                continue
            ids = out.token_ids
            if ids and ids[-1] in request.eos_token_ids:
                ids = ids[:-1]  # the template writes the end of the turn itself
            if self.tokenizer.decode(ids) == out.text:
                self.answers.record(request.tenant, out.text, ids)

    def _grammar_masks(self, sched_out: SchedulerOutput, failed: dict[str, str]) -> None:
        """Each sampling request's grammar's mask of the tokens it allows next (a grammar
        that raises: its request into ``failed``)."""
        requests = self.scheduler.requests
        for item in sched_out.scheduled:
            request = requests.get(item.request_id) if item.sample else None
            if request is not None and request.grammar is not None:
                try:
                    sched_out.token_bitmasks[item.request_id] = request.grammar.bitmask()
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    failed[item.request_id] = f"the grammar failed: {exc}"

    def _fail_rows(self, failed: dict[str, str]) -> list[RequestUpdate]:
        """End the requests whose rows failed (FinishReason.ERROR, their blocks freed) before
        the scheduler advances the others; their final updates, with no new token."""
        requests = [self.scheduler.requests.get(request_id) for request_id in failed]
        requests = [r for r in requests if r is not None and not r.is_finished]
        for request in requests:
            logger.warning(
                "request %s failed alone: %s", request.request_id, failed[request.request_id]
            )
        self.scheduler.finish_requests([r.request_id for r in requests], FinishReason.ERROR)
        return [RequestUpdate(r, [], True) for r in requests]

    def _execute(self, sched_out: SchedulerOutput) -> tuple[ModelOutput, dict[str, int]]:
        """Run the model, streaming the step's planned loads in on a loader thread. Returns
        the model's output and the requests whose loads came up short (blocks that arrived)."""
        loader = (
            KVLoader(self.store, self.runner, sched_out.kv_loads) if sched_out.kv_loads else None
        )
        t0 = time.perf_counter()
        if loader is None:
            model_out = self.runner.execute(sched_out)
        else:
            try:
                model_out = self.runner.execute(sched_out, layer_ready=loader.wait_layer)
            finally:
                result = loader.finish()
        elapsed = time.perf_counter() - t0
        short: dict[str, int] = {}
        if loader is not None:
            short = result.short
            self.store.count_loaded(result.num_loaded_blocks, result.blocks_by_tier)
            elapsed -= loader.waited  # the model's own time: what recomputing would cost
        if self.store is not None and sched_out.scheduled:
            self.store.observe_step(
                [(s.start_pos, s.num_tokens) for s in sched_out.scheduled], elapsed
            )
        return model_out, short

    def _save_blocks(self) -> None:
        """Copy the blocks the scheduler queued for the tiers out of the pool (a memory copy
        here; packing and I/O run on the store's writer thread)."""
        for save in self.scheduler.take_saves():
            payload = self.runner.save_kv(save.block_ids)
            self.store.write(save.chunk, payload, save.ttl_s, owner=save.tenant, soon=save.soon)

    # ---- introspection ------------------------------------------------------------------

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_preemptions=scheduler.num_preemptions,
            num_load_rollbacks=scheduler.num_load_rollbacks,
            num_admission_skips=scheduler.num_admission_skips,
            num_admission_aged=scheduler.num_admission_aged,
            oldest_waiting_s=oldest_wait_s(scheduler.waiting, time.perf_counter()),
            num_last_rows_reused=self.num_last_rows_reused,
            num_generated_tokens=self.num_generated_tokens,
            kv=self.kv_manager.stats(scheduler.running),
            store=self.store.stats() if self.store is not None else None,
            **tool_pause_stats(self.tool_pauses.counts),
            **grammar_stats(self.grammars.counts),
        )

    def add_public_prefix(self, prompt: Prompt) -> int:
        """Declare a prefix every tenant may share (e.g. a system prompt); chat messages are
        rendered without a generation prompt. Returns its length in tokens."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            token_ids = self.tokenizer.encode_chat(prompt, add_generation_prompt=False)
        else:
            token_ids = self.tokenize(prompt)
        self.kv_manager.add_public_prefix(token_ids)
        return len(token_ids)

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity()

    # ---- sessions and the tiers ---------------------------------------------------------

    def park(self, session_id: str, tenant: str = "default") -> int:
        """Move a conversation's KV out of the device pool, into the tiers, until its next
        turn (sent with the same ``session_id``) loads it back.

        Waits for its blocks to be written, then frees the device blocks that some tier now
        holds (blocks shared with running requests stay). Returns the number of tokens parked.

        Raises:
            SessionNotFound: no finished turn of this session in this tenant.
            SessionBusy: a request of this session is in flight.
        """
        hashes = self.sessions.last_turn(tenant, session_id)
        if hashes is None:
            raise SessionNotFound("session_id", f"no finished turn of session {session_id!r}")
        if any(
            r.options.session_id == session_id and r.tenant == tenant
            for r in self.scheduler.requests.values()
        ):
            raise SessionBusy("session_id", f"session {session_id!r} has a request in flight")
        if self.store is None or not hashes:
            return 0
        self.store.flush()
        num_stored = self.store.num_stored_blocks(hashes, len(hashes))
        self.kv_manager.drop_cached(hashes[:num_stored])
        return num_stored * self.kv_manager.block_size

    def tool_pause(self, request_id: str) -> int:
        """A finished turn ended in tool calls: keep its KV in the pool ahead of unkept
        blocks until the turn with the tool's result (``ToolPauses``). Returns the tokens
        kept (0: the turn is not remembered)."""
        found = self.tool_pauses.pause(request_id)
        if found is None:
            return 0
        tenant, hashes = found
        self.kv_manager.retain_cached(hashes, tenant, self.tool_pauses.pause_s)
        return len(hashes) * self.kv_manager.block_size

    def flush(self) -> None:
        """Wait until every queued write has reached the tiers."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        """Flush pending writes to the tiers and release them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.grammars.close()
        if self.store is not None:
            self.store.close()

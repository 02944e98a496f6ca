"""Requests' constraints compiled once, under a deadline, cached per tenant. No torch.

``GrammarCompiler.compile(spec, tenant)`` turns a ``StructuredOutput`` into a ``Grammar``:

1. **The cache.** A constraint this tenant had compiled before (same kind and text) is a copy
   of the compiled matcher (``LLMatcher.deep_copy``: µs); one it had refused is the same 400 at
   once. Entries are keyed by tenant, so a hit tells nobody what another tenant sent, and
   bounded (``grammar_cache_entries`` in all, an eighth of them per tenant).
2. **A slot.** At most ``grammar_workers`` compiles run at once, at most
   ``grammar_compiles_per_tenant`` of one tenant's; a request that gets no slot within the
   timeout is a 429 (``GrammarBusy``).
3. **The worker.** The constraint is compiled in a worker process (``grammar_workers.py``)
   that is killed when the compile runs past the timeout (a 400 naming the field:
   ``--grammar-compile-timeout``; a worker's own start does not count) or when the caller
   goes away (``cancelled`` set).
4. **The engine's compile.** Compiled in time there, it is compiled once here, in the calling
   thread (``AsyncEngine`` runs it on compile threads of lower CPU priority), its first mask
   checked, and the matcher kept in the cache.

A first compile thus costs twice the worker's time (both bounded by the timeout); a repeated
one costs a copy. ``grammar_workers=0`` skips the workers: one compile in the calling thread,
no deadline (trusted offline use).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import json
import logging
import threading
import time
from typing import Any

from kvwise.config import GrammarConfig
from kvwise.engine.grammar_workers import (
    CompileCancelled,
    CompileTimeout,
    GrammarWorkers,
    WorkerFailed,
    nice_this_thread,
)
from kvwise.engine.structured import (
    PARSER_LIMITS,
    Grammar,
    first_mask_error,
    grammar_text,
    parser_limits,
)
from kvwise.errors import GrammarBusy, InvalidRequest
from kvwise.types import StructuredOutput

logger = logging.getLogger("kvwise")

OUTCOMES = ("compiled", "cached", "invalid", "timeout", "cancelled", "busy")
_SLOT_POLL_S = 0.01


class _Cache:
    """Compiled matchers (or the error a constraint got) by ``(tenant, digest)``, LRU,
    ``entries`` in all and ``per_tenant`` of one tenant's."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.per_tenant = max(1, entries // 8)
        self._items: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._count: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> Any:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: tuple[str, str], item: Any) -> None:
        if self.entries == 0:
            return
        with self._lock:
            if key in self._items:
                self._items[key] = item
                return
            tenant = key[0]
            if self._count[tenant] >= self.per_tenant:  # this tenant's oldest goes
                self._drop(next(k for k in self._items if k[0] == tenant))
            elif len(self._items) >= self.entries:
                self._drop(next(iter(self._items)))
            self._items[key] = item
            self._count[tenant] += 1

    def _drop(self, key: tuple[str, str]) -> None:
        del self._items[key]
        self._count[key[0]] -= 1
        if not self._count[key[0]]:
            del self._count[key[0]]

    def __len__(self) -> int:
        return len(self._items)


def _digest(spec: StructuredOutput) -> str:
    text = json.dumps([spec.kind, spec.value], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class GrammarCompiler:
    """Compiles requests' constraints over one model's vocabulary (thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int, config: GrammarConfig | None = None):
        self._backend = tokenizer  # a kvwise Tokenizer: its tokenizers backend and EOS ids
        self.vocab_size = vocab_size
        self.config = config or GrammarConfig()
        self.timeout_s = float(self.config.grammar_compile_timeout_s)
        self._ll_tokenizer = None
        self._workers: GrammarWorkers | None = None
        self._lock = threading.Lock()
        self._cache = _Cache(self.config.grammar_cache_entries)
        self.counts: collections.Counter[str] = collections.Counter()

    # ---- the vocabulary and the workers, built on first use -----------------------------

    def _eos(self) -> list[int]:
        eos = sorted(self._backend.eos_token_ids)
        if not eos:
            raise InvalidRequest("response_format", "the model has no EOS token")
        return eos

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._backend.backend_json(), n_vocab=self.vocab_size, eos_token=self._eos()
                )
            return self._ll_tokenizer

    def workers(self) -> GrammarWorkers | None:
        """The worker pool (None with ``grammar_workers=0``)."""
        if self.config.grammar_workers == 0:
            return None
        with self._lock:
            if self._workers is None:
                self._workers = GrammarWorkers(
                    self._backend.backend_json(),
                    self.vocab_size,
                    self._eos(),
                    workers=self.config.grammar_workers,
                    per_tenant=self.config.grammar_compiles_per_tenant,
                )
            return self._workers

    def warm(self) -> None:
        """Build the vocabulary and start the workers now, so that the first constraint does
        not wait for them (~1 s at a 49k vocabulary). Runs in a background thread."""

        def build() -> None:
            nice_this_thread()
            try:
                self._tokenizer()
                workers = self.workers()
                if workers is not None:
                    workers.warm()
            except Exception:  # noqa: BLE001 - the first compile meets it again and says why
                logger.warning("grammar compiler: warming up failed", exc_info=True)

        threading.Thread(target=build, name="kvwise-grammar-warm", daemon=True).start()

    # ---- compiling ----------------------------------------------------------------------

    def cached(self, spec: StructuredOutput, tenant: str) -> Grammar | None:
        """The tenant's compiled copy of ``spec`` (raising the error it got before), or None."""
        item = self._cache.get((tenant, _digest(spec)))
        if item is None:
            return None
        self._count("cached")
        if isinstance(item, str):
            raise InvalidRequest(spec.field, item)
        return Grammar(item.deep_copy())

    def try_start(self, tenant: str) -> bool:
        """Take a compile slot (never blocks); every True must be paired with `finish`."""
        workers = self.workers()
        return True if workers is None else workers.try_acquire(tenant)

    def finish(self, tenant: str) -> None:
        if self._workers is not None:
            self._workers.release(tenant)

    def compile(
        self,
        spec: StructuredOutput,
        tenant: str = "default",
        cancelled: threading.Event | None = None,
    ) -> Grammar:
        """``spec`` compiled for one request, waiting for a slot (blocking form).

        Raises:
            InvalidRequest: refused, or not compiled within the timeout (naming ``spec.field``).
            GrammarBusy: no compile slot within the timeout.
        """
        hit = self.cached(spec, tenant)
        if hit is not None:
            return hit
        deadline = time.monotonic() + self.timeout_s
        while not self.try_start(tenant):
            if time.monotonic() >= deadline or (cancelled is not None and cancelled.is_set()):
                self._count("busy")
                raise GrammarBusy(spec.field)
            time.sleep(_SLOT_POLL_S)
        try:
            return self.compile_started(spec, tenant, cancelled)
        finally:
            self.finish(tenant)

    def compile_started(
        self,
        spec: StructuredOutput,
        tenant: str,
        cancelled: threading.Event | None = None,
    ) -> Grammar:
        """Compile with a slot taken (`try_start`): in a worker within the timeout, then here."""
        key = (tenant, _digest(spec))
        hit = self.cached(spec, tenant)  # compiled while this one waited for its slot
        if hit is not None:
            return hit
        workers = self.workers()
        if workers is not None:
            self._check_in_worker(workers, spec, key, cancelled)
        matcher = self._compile_here(spec, key)
        self._count("compiled")
        return Grammar(matcher.deep_copy())

    async def compile_async(
        self, spec: StructuredOutput, tenant: str, executor: concurrent.futures.Executor
    ) -> Grammar:
        """`compile` for asyncio callers: the slot is awaited here (no thread waits for one),
        the compile runs on ``executor``; cancelling the caller kills the worker's compile."""
        hit = self.cached(spec, tenant)
        if hit is not None:
            return hit
        deadline = time.monotonic() + self.timeout_s
        while not self.try_start(tenant):
            if time.monotonic() >= deadline:
                self._count("busy")
                raise GrammarBusy(spec.field)
            await asyncio.sleep(_SLOT_POLL_S)
        cancelled = threading.Event()

        def run() -> Grammar:
            try:
                return self.compile_started(spec, tenant, cancelled)
            finally:
                self.finish(tenant)  # NOTE: here, not in the caller: a cancelled caller
                # returns before the worker is killed

        try:
            future = executor.submit(run)
        except BaseException:
            self.finish(tenant)
            raise
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def _check_in_worker(
        self, workers: GrammarWorkers, spec: StructuredOutput, key, cancelled
    ) -> None:
        job = {"kind": spec.kind, "value": spec.value, "field": spec.field, "limits": PARSER_LIMITS}
        try:
            check = workers.check(job, self.timeout_s, cancelled)
        except CompileCancelled:
            self._count("cancelled")
            raise InvalidRequest(spec.field, "the request was cancelled") from None
        except CompileTimeout:
            detail = (
                f"the {spec.kind} did not compile within {self.timeout_s:g} s "
                "(--grammar-compile-timeout); simplify it"
            )
            raise self._refuse(spec, key, "timeout", detail) from None
        except WorkerFailed as exc:  # a crash on this constraint: refuse it, not the engine
            detail = f"invalid {spec.kind}: the compiler failed ({exc})"
            raise self._refuse(spec, key, "invalid", detail) from None
        if check.error is not None:
            raise self._refuse(spec, key, "invalid", check.error)

    def _refuse(self, spec: StructuredOutput, key, outcome: str, detail: str) -> InvalidRequest:
        """Count and cache a refusal; the error to raise."""
        self._count(outcome)
        self._cache.put(key, detail)
        return InvalidRequest(spec.field, detail)

    def _compile_here(self, spec: StructuredOutput, key) -> Any:
        import llguidance

        text = grammar_text(spec)
        matcher = llguidance.LLMatcher(self._tokenizer(), text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            error = f"invalid {spec.kind}: {matcher.get_error()[:500]}"
        else:
            error = first_mask_error(matcher, spec.kind)
        if error is not None:
            raise self._refuse(spec, key, "invalid", error)
        self._cache.put(key, matcher)
        return matcher

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1

    def close(self) -> None:
        """Stop the worker processes. Idempotent."""
        if self._workers is not None:
            self._workers.close()

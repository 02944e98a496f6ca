"""One engine, many asyncio callers: the step loop on its own thread, outputs through queues.
`AsyncEngine` is the in-process `engine/client.EngineClient`, the interface the server uses.

Contract:

- Every `LLMEngine` call (add_request, step, abort, stats, check_integrity) runs on the engine
  thread, except ``tokenize`` / ``tokenized`` and decoding (they touch no engine state: the
  tokenizer threads run them, for `add_request`, `tokenize` and `detokenize`). Other threads
  never touch the engine: they post commands (`submit`) that the thread runs between two
  steps, in the order they were posted.
- What a request brings is handled off the engine thread, before it is posted: the chat
  template is rendered and the prompt tokenized on a small pool of tokenizer threads
  (``LLMEngine.tokenize`` only reads the tokenizer), with its cost bounded before any work
  (``engine/prompts.py``: the message count, the characters, the rendering), so one caller's
  huge prompt never holds up the steps of the others. A structured output's constraint is
  compiled on compile threads of its own (``GrammarCompiler``: a deadline, slots per tenant).
- `add_request` returns a `RequestStream` only once the request is admitted, so admission errors
  surface before any output: `InvalidRequest` (a `ValueError`) naming the field (bad prompt,
  prompt over the context) and `QueueFullError` when the scheduler's bounded waiting queue is
  full. Every error raised here is a `kvwise.errors.KVWiseError` carrying its HTTP status.
- A stream closed before its request finished (the caller was cancelled, the client went away)
  aborts the request; the abort runs before the next step, so its blocks are free at once.
- A step that raises fails the requests in flight (their streams raise `EngineStepError`), which
  are aborted; the loop goes on if the pool passes its integrity check, else the engine is dead
  and every later call raises `EngineDeadError`. A request whose own row failed ends alone.
- Once the loop has stopped (shutdown or crash), the engine thread calls `LLMEngine.close()`,
  so KV writes still queued for the tiers (host, disk, Redis) reach them before the process
  exits; `shutdown` waits for that flush.

The step itself (a model forward on CPU) holds the thread for its whole length; the event loop
that serves HTTP never waits on it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvwise.engine.async_tokenize import TokenizerThreads
from kvwise.engine.client import QueueStream, RequestStream
from kvwise.engine.grammar_workers import nice_this_thread
from kvwise.engine.llm_engine import LLMEngine
from kvwise.engine.prompts import Prompt
from kvwise.engine.stats import EngineStats
from kvwise.errors import EngineDeadError, EngineStepError, QueueFullError
from kvwise.store.costmodel import CostCurves
from kvwise.types import FinishReason, RequestOptions, RequestOutput, SamplingParams
from kvwise.utils import format_bytes

logger = logging.getLogger("kvwise")

_T = TypeVar("_T")

IDLE_AUDIT_DELAY_S = 0.02  # idle this long before the pool's audit (``idle_audit_delay_s``)


__all__ = ["AsyncEngine", "EngineDeadError", "EngineStepError", "QueueFullError"]


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | BaseException items


class AsyncEngine(TokenizerThreads):
    """Runs one `LLMEngine` on a background thread and serves it to asyncio code (an
    `EngineClient`).

    Args:
        engine: the engine; from now on only the engine thread may call it.
        retry_after_s: the Retry-After hint carried by `QueueFullError`.
        close_engine: close the engine (flushing its pending tier writes) once the loop has
            stopped; False leaves it open, to be reused after `shutdown` (tests).
        idle_refresh_s: while idle, stats are refreshed this often.
        idle_audit_delay_s: idle this long before the pool's integrity audit, so that the
            event loop first takes the last step's outputs (the audit holds the GIL).
        tokenizer_threads: threads that render and tokenize prompts (off the engine thread).
    """

    def __init__(
        self,
        engine: LLMEngine,
        retry_after_s: int = 1,
        *,
        close_engine: bool = True,
        idle_refresh_s: float = 1.0,
        tokenizer_threads: int = 2,
        idle_audit_delay_s: float = IDLE_AUDIT_DELAY_S,
    ) -> None:
        self.engine = engine
        self.idle_audit_delay_s = idle_audit_delay_s
        self._tokenizers = concurrent.futures.ThreadPoolExecutor(
            tokenizer_threads, thread_name_prefix="kvwise-tokenize"
        )
        # a compile slot's thread each (``GrammarCompiler``), at a lower CPU priority
        self._compilers = concurrent.futures.ThreadPoolExecutor(
            max(1, engine.grammars.config.grammar_workers),
            thread_name_prefix="kvwise-grammar",
            initializer=nice_this_thread,
        )
        self.idle_refresh_s = idle_refresh_s
        self.retry_after_s = retry_after_s
        self.close_engine = close_engine
        self.max_model_len = engine.max_model_len  # immutable: readable from any thread
        self._commands: collections.deque[tuple[Callable, concurrent.futures.Future]] = (
            collections.deque()
        )
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None  # why the loop is not running
        self._loop_done = threading.Event()  # the loop has stopped (the close may still run)
        self._engine_closed = False
        self._integrity_checks = 0  # idle-time pool audits passed
        self._refresh_stats()
        self._lock = threading.Lock()  # guards start/shutdown and the dead flag

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return
            if self._dead:
                raise EngineDeadError(self._dead)
            self._thread = threading.Thread(target=self._run, name="kvwise-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ask the loop to stop after the current step, without waiting: requests in flight
        are aborted and their streams raise `EngineDeadError` (the server ends them with an
        error event). `shutdown` waits for it."""
        with self._lock:
            self._stopping = True
        self._wake.set()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop after the current step; requests in flight are aborted and their
        streams raise `EngineDeadError`. Then the engine is closed (see ``close_engine``).
        Safe to call from any thread, more than once.

        Waits up to ``timeout`` seconds for the loop to stop, then for the close to flush the
        writes queued for the tiers (bounded by the store's pending-write cap and its tiers'
        timeouts), so that they are on disk / in Redis when this returns.
        """
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake.set()
        if thread is None:
            self._close_engine()  # never started: no other thread touches the engine
            return
        if thread is threading.current_thread():
            return  # a command asked for it: the loop stops and closes once it returns
        if not self._loop_done.wait(timeout):
            logger.warning(
                "the engine loop did not stop within %s s; writes queued for the KV tiers "
                "may be lost",
                timeout,
            )
            return
        thread.join()

    @property
    def is_running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._dead

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    # ---- commands -------------------------------------------------------------------------

    def submit(self, fn: Callable[[LLMEngine], _T]) -> concurrent.futures.Future[_T]:
        """Run ``fn(engine)`` on the engine thread between two steps; returns its future."""
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if threading.current_thread() is self._thread:
            _run_command(fn, self.engine, future)
            return future
        with self._lock:  # NOTE: so that no command lands after the exit drain (it would hang)
            if self._dead or self._stopping:
                future.set_exception(EngineDeadError(self._dead or "the engine is shutting down"))
                return future
            self._commands.append((fn, future))
        self._wake.set()
        return future

    async def call(self, fn: Callable[[LLMEngine], _T]) -> _T:
        """``await`` form of `submit`."""
        return await asyncio.wrap_future(self.submit(fn))

    def call_sync(self, fn: Callable[[LLMEngine], _T], timeout: float | None = 30.0) -> _T:
        """Blocking form of `submit`, for threads that are not the engine's (tests, tools)."""
        return self.submit(fn).result(timeout)

    def stats(self) -> EngineStats:
        """`LLMEngine.stats()` as of the last step or command (never waits for a step), with
        the idle-time integrity checks counted. Immutable: safe to read from any thread."""
        return self._stats

    def cost_curves(self) -> CostCurves | None:
        """The tiered store's cost model as curves, for prompts up to the context
        (``TieredStore.cost_curves``: reads the fits only, safe from any thread); None without
        tiers."""
        store = self.engine.store
        if store is None or not store.tiers:
            return None
        return store.cost_curves(self.max_model_len)

    # ---- requests -------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        options: RequestOptions | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestStream:
        """Admit a request and return its output stream (``options.session_id`` names the
        session that `park` takes, with the same tenant).

        Raises:
            InvalidRequest: bad input, naming the field (``"prompt: ..."``).
            QueueFullError: the waiting queue is full.
            EngineDeadError: the engine loop is not running.
        """
        loop = asyncio.get_running_loop()
        if self._dead or self._stopping:
            raise EngineDeadError(self._dead or "the engine is shutting down")

        # NOTE: off the engine thread and off the event loop: bad input is refused here, and
        # a large prompt costs a tokenizer thread, never a step
        tenant = options.tenant if options is not None else "default"
        try:
            tokenized = await loop.run_in_executor(
                self._tokenizers, self.engine.tokenized, prompt, tenant
            )
            grammar = None
            if params.structured is not None:  # its own threads: a slow one stalls no prompt
                grammar = await self.engine.grammars.compile_async(
                    params.structured, tenant, self._compilers
                )
        except RuntimeError as exc:  # the pool is shut down: the loop has stopped
            if self._dead or self._stopping:
                raise EngineDeadError(self._dead or "the engine is shutting down") from None
            raise exc
        queue: asyncio.Queue = asyncio.Queue()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        retry_after_s = self.retry_after_s

        def add(engine: LLMEngine) -> None:
            try:
                engine.add_request(
                    tokenized, params, options, request_id=request_id, grammar=grammar
                )
            except QueueFullError:
                raise QueueFullError(retry_after_s) from None
            self._sinks[request_id] = _Sink(loop, queue)

        try:
            await asyncio.wrap_future(self.submit(add))
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may have run already; abort after it is a no-op
            raise
        return QueueStream(request_id, queue, self.abort)

    async def generate(
        self, prompt: Prompt, params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; leaving the loop early aborts it."""
        stream = await self.add_request(prompt, params, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def park(self, session_id: str, tenant: str = "default") -> int:
        """`LLMEngine.park` on the engine thread (between two steps): move a session's KV
        to the tiers. Returns the tokens parked.

        Raises:
            SessionNotFound: no finished turn of that session in this tenant.
            SessionBusy: a request of that session is in flight.
            EngineDeadError: the engine loop is not running.
        """
        return await self.call(lambda engine: engine.park(session_id, tenant))

    async def tool_pause(self, request_id: str) -> int:
        """`LLMEngine.tool_pause` on the engine thread: a finished turn ended in tool calls."""
        return await self.call(lambda engine: engine.tool_pause(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request (fire and forget); unknown or finished ids are ignored."""

        def abort(engine: LLMEngine) -> None:
            self._sinks.pop(request_id, None)
            engine.abort([request_id])

        self.submit(abort)

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                # NOTE: clear before draining, so a command posted after the drain wakes the wait.
                self._wake.clear()
                self._run_commands()
                if self._stopping:
                    break
                if engine.has_unfinished():
                    self._step()
                else:
                    # NOTE: the audit holds the GIL for ~1 ms: first let the event loop take the
                    # last step's outputs (a first token waited for it: 1.4 ms of a 12 ms hit)
                    if self._wake.wait(self.idle_audit_delay_s):
                        continue
                    # idle: audit the pool; an inconsistent one stops the engine (503)
                    engine.check_integrity()
                    self._integrity_checks += 1
                    self._refresh_stats()
                    # NOTE: the stats (the tiers' gauges: the writer keeps writing after the
                    # last step) are refreshed while idle; the pool is audited once per idle
                    while not self._wake.wait(self.idle_refresh_s):
                        self._refresh_stats()
        except BaseException as exc:  # noqa: BLE001 - the loop must report why it ended
            logger.exception("engine loop crashed")
            reason = f"the engine loop crashed: {exc!r}"
        else:
            reason = "the engine is shut down"
        with self._lock:
            self._dead = reason
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
        self._compilers.shutdown(wait=False, cancel_futures=True)
        self._close_all(EngineDeadError(reason))
        self._loop_done.set()
        self._close_engine()

    def _close_engine(self) -> None:
        """Close the engine once (flushing its tier writes) and log what the flush wrote."""
        with self._lock:
            if not self.close_engine or self._engine_closed:
                return
            self._engine_closed = True
        store = self.engine.store
        try:
            before = store.stats() if store is not None else None
            t0 = time.perf_counter()
            self.engine.close()
            if store is not None:
                after = store.stats()
                logger.info(
                    "KV tiers flushed on shutdown in %.2f s: %s pending, entries written: %d",
                    time.perf_counter() - t0,
                    format_bytes(before.pending_write_bytes),
                    after.chunks_written - before.chunks_written,
                )
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.exception("closing the engine (flushing the KV tiers) failed")

    def _refresh_stats(self) -> None:
        self._stats = dataclasses.replace(
            self.engine.stats(), kv_integrity_checks=self._integrity_checks
        )

    def _run_commands(self) -> None:
        while self._commands:
            fn, future = self._commands.popleft()
            _run_command(fn, self.engine, future)

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting the requests in flight")
            ids = list(engine.scheduler.requests)
            engine.abort(ids)
            error = EngineStepError(f"the engine step failed: {exc!r}")
            self._deliver([(self._sinks.pop(rid), error) for rid in ids if rid in self._sinks])
            engine.check_integrity()  # raises (the loop dies) if the pool is now inconsistent
            self._refresh_stats()
            return
        items = []
        for out in outputs:
            sink = (self._sinks.pop if out.finished else self._sinks.get)(out.request_id, None)
            if sink is None:
                continue
            if out.finish_reason is FinishReason.ERROR:  # its row failed alone: its stream raises
                out = EngineStepError(f"this request failed: {out.error}")
            items.append((sink, out))
        self._deliver(items)
        self._refresh_stats()

    def _deliver(self, items: list[tuple[_Sink, RequestOutput | BaseException]]) -> None:
        """Hand outputs to their event loops: one thread-safe callback per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sink, item in items:
            by_loop.setdefault(sink.loop, []).append((sink.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _close_all(self, error: BaseException) -> None:
        """On exit: fail pending commands, abort what is in flight, end every open stream."""
        while self._commands:
            _, future = self._commands.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        try:
            ids = list(self.engine.scheduler.requests)
            if ids:
                self.engine.abort(ids)
            self._refresh_stats()
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.exception("aborting requests at shutdown failed")
        sinks, self._sinks = self._sinks, {}
        self._deliver([(sink, error) for sink in sinks.values()])


def _run_command(fn: Callable, engine: LLMEngine, future: concurrent.futures.Future) -> None:
    if not future.set_running_or_notify_cancel():
        return  # the caller gave up before it ran
    try:
        future.set_result(fn(engine))
    except Exception as exc:
        future.set_exception(exc)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)

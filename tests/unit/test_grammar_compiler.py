"""Grammar compiles with a budget (issue 45, item 1), over the default model's real vocabulary
and real llguidance: a compile past its deadline or cancelled kills its worker process and
answers at once; a refusal and a compile are cached per tenant (a copy, not a new compile);
compile slots are capped per tenant and in all; the cache is bounded per tenant."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from kvwise.config import EngineConfig, GrammarConfig
from kvwise.engine.grammar_compiler import GrammarCompiler
from kvwise.errors import GrammarBusy, InvalidRequest
from kvwise.types import StructuredOutput

SLOW_N = 450  # minutes of llguidance's lexer construction
TIMEOUT_S = 1.0


def slow(tag: str = "") -> StructuredOutput:
    patterns = {f"^{tag}[a-z]{{{i}}}$": {"type": "integer"} for i in range(1, SLOW_N + 1)}
    return StructuredOutput("json", {"type": "object", "patternProperties": patterns}, "rf")


def small(name: str = "n") -> StructuredOutput:
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    return StructuredOutput("json", schema, "rf")


@pytest.fixture
def compiler(tok):
    made = []

    def make(**kwargs) -> GrammarCompiler:
        kwargs.setdefault("grammar_compile_timeout_s", TIMEOUT_S)
        made.append(GrammarCompiler(tok, tok.vocab_size, GrammarConfig(**kwargs)))
        return made[-1]

    yield make
    for c in made:
        c.close()


def accepts(grammar, tok, text: str) -> bool:
    return all(grammar.accept(t) for t in tok.encode(text, add_special_tokens=False))


def test_compiles_once_then_copies(compiler, tok):
    c = compiler()
    first = c.compile(small(), "alice")
    second = c.compile(small(), "alice")
    assert c.counts["compiled"] == 1 and c.counts["cached"] == 1
    assert first is not second and first._matcher is not second._matcher
    assert accepts(first, tok, '{"n":12}')
    # the copies are independent: one fed a value, the other still at its start
    assert not second.finished
    assert accepts(second, tok, '{"n":')
    # another tenant compiles its own
    c.compile(small(), "bob")
    assert c.counts["compiled"] == 2
    assert c.workers().num_spawned >= 1


def test_past_the_deadline_is_a_400_and_the_worker_dies(compiler):
    c = compiler()
    c.compile(small(), "warm")  # the worker started (its start does not count)
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"^rf: the json did not compile within 1 s"):
        c.compile(slow(), "mallory")
    assert time.monotonic() - start < TIMEOUT_S + 0.5
    assert c.counts["timeout"] == 1 and c.workers().num_killed == 1
    assert c.workers().busy() == 0
    start = time.monotonic()  # remembered: the same refusal at once, no compile
    with pytest.raises(InvalidRequest, match="did not compile within"):
        c.compile(slow(), "mallory")
    assert time.monotonic() - start < 0.05 and c.counts["cached"] == 1
    c.compile(small("m"), "mallory")  # the replacement worker serves the next one
    assert c.counts["compiled"] == 2


def test_cancelled_compile_stops_at_once(compiler):
    c = compiler(grammar_compile_timeout_s=60)
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="cancelled"):
        c.compile(slow(), "mallory", cancelled)
    assert time.monotonic() - start < 0.3 + 1.0  # polled every 50 ms
    assert c.counts["cancelled"] == 1 and c.workers().num_killed == 1
    c.compile(small(), "mallory")  # not remembered as refused: a cancel says nothing of it


def test_async_cancel_kills_the_compile(compiler):
    c = compiler(grammar_compile_timeout_s=60)
    executor = concurrent.futures.ThreadPoolExecutor(2)

    async def scenario():
        task = asyncio.ensure_future(c.compile_async(slow(), "mallory", executor))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    deadline = time.monotonic() + 1.0
    while c.workers().busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.workers().busy() == 0 and c.counts["cancelled"] == 1
    executor.shutdown()


def test_slots_per_tenant_and_in_all(compiler):
    c = compiler(grammar_workers=2, grammar_compiles_per_tenant=1)
    assert c.try_start("alice")
    assert not c.try_start("alice")  # alice's one slot is taken
    assert c.try_start("bob")
    assert not c.try_start("carol")  # both workers taken
    c.finish("alice")
    assert c.try_start("carol")
    with pytest.raises(GrammarBusy) as info:  # waits its deadline for bob's slot, then 429
        c.compile(small(), "bob")
    assert info.value.status == 429 and info.value.param == "rf"
    assert c.counts["busy"] == 1
    c.finish("bob"), c.finish("carol")


def test_cache_is_bounded_per_tenant(compiler):
    c = compiler(grammar_cache_entries=16)  # 2 per tenant
    for name in ("a", "b", "c"):
        c.compile(small(name), "alice")
    c.compile(small("a"), "alice")  # evicted by "c": compiled again
    assert c.counts["compiled"] == 4 and c.counts["cached"] == 0
    c.compile(small("c"), "alice")
    assert c.counts["cached"] == 1


def test_refusals_name_the_field_and_are_cached(compiler):
    c = compiler()
    bad = StructuredOutput("json", {"$ref": "#"}, "response_format")
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="^response_format: the json admits no value"):
            c.compile(bad, "alice")
    assert c.counts["invalid"] == 1 and c.counts["cached"] == 1
    with pytest.raises(InvalidRequest, match="^g: invalid grammar"):
        c.compile(StructuredOutput("grammar", "start: ((", "g"), "alice")


def test_without_workers_compiles_in_this_thread(compiler, tok):
    c = compiler(grammar_workers=0)
    grammar = c.compile(small(), "alice")
    assert c.workers() is None and accepts(grammar, tok, '{"n":1')


@pytest.mark.parametrize(
    "kwargs",
    [
        {"grammar_compile_timeout_s": 0},
        {"grammar_compile_timeout_s": float("nan")},
        {"grammar_workers": -1},
        {"grammar_compiles_per_tenant": 0},
        {"grammar_cache_entries": True},
    ],
)
def test_config_names_the_bad_option(kwargs):
    with pytest.raises(ValueError, match=f"^{next(iter(kwargs))}:"):
        EngineConfig.from_kwargs(**kwargs)


def test_a_long_compile_runs_in_the_idle_scheduling_class(compiler):
    """A worker waits in SCHED_IDLE, compiles at nice 10 for its first DEMOTE_AFTER_S, then
    goes back to SCHED_IDLE for the rest: a slow schema takes no CPU the engine wants."""
    import os

    from kvwise.engine import grammar_workers

    c = compiler(grammar_compile_timeout_s=60)
    c.compile(small(), "warm")
    workers = c.workers()
    pids = [w.proc.pid for w in workers._idle]
    assert pids and all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in pids)
    assert all(os.getpriority(os.PRIO_PROCESS, p) == grammar_workers.WORKER_NICE for p in pids)
    policies = []

    def watch() -> None:  # the compiling worker's class, sampled while it runs
        time.sleep(0.02)
        busy = [p for p in pids if all(w.proc.pid != p for w in workers._idle)]
        policies.append(os.sched_getscheduler(busy[0]) if busy else None)
        time.sleep(grammar_workers.DEMOTE_AFTER_S + 0.3)
        policies.append(os.sched_getscheduler(busy[0]) if busy else None)

    watcher = threading.Thread(target=watch)
    watcher.start()
    cancelled = threading.Event()
    threading.Timer(grammar_workers.DEMOTE_AFTER_S + 0.6, cancelled.set).start()
    with pytest.raises(InvalidRequest, match="cancelled"):
        c.compile(slow(), "mallory", cancelled)
    watcher.join()
    assert policies == [os.SCHED_OTHER, os.SCHED_IDLE]

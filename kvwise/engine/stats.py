"""Typed engine statistics: what ``llm.stats()``, ``/metrics`` and the benchmarks read, by
attribute. Built fresh (and immutable) on every call, so a snapshot can cross threads. Each
exposed field names its metric (``core.stat_fields``); ``kv`` and ``store`` are stats of their
own, with their own fields' metrics."""

from __future__ import annotations

from dataclasses import dataclass

from kvwise.core.kv_stats import KVCacheStats
from kvwise.core.stat_fields import GAUGE, metric
from kvwise.engine.grammar_compiler import OUTCOMES as GRAMMAR_OUTCOMES
from kvwise.store.stats import StoreStats

_RESUMED = "kvwise_tool_resumed_tokens"
_RESUMED_HELP = (
    "paused tokens of resumed turns: found in the pool, loaded from a tier, or recomputed"
)
_GRAMMAR = "kvwise_grammar_compiles"
_GRAMMAR_HELP = (
    "structured outputs' constraints by outcome: compiled, cached (a copy of the tenant's "
    "earlier compile or refusal), invalid, timeout (--grammar-compile-timeout), cancelled "
    "(the client went away), busy (no compile slot in time)"
)


def grammar_stats(counts) -> dict[str, int]:
    """``EngineStats``' grammar fields from ``GrammarCompiler.counts``."""
    return {f"grammar_{outcome}": counts[outcome] for outcome in GRAMMAR_OUTCOMES}


def tool_pause_stats(counts) -> dict[str, int]:
    """``EngineStats``' tool-pause fields from ``ToolPauses.counts``."""
    return {
        "tool_pauses": counts.pauses,
        "tool_resumes": counts.resumes,
        "tool_resumed_device_tokens": counts.resumed_device_tokens,
        "tool_resumed_tier_tokens": counts.resumed_tier_tokens,
        "tool_recomputed_tokens": counts.recomputed_tokens,
    }


@dataclass(frozen=True)
class EngineStats:
    num_running: int = metric("kvwise_requests_running", "requests running", GAUGE)
    num_waiting: int = metric("kvwise_requests_waiting", "requests in the waiting queue", GAUGE)
    num_preemptions: int = metric(  # total
        "kvwise_preemptions", "requests preempted for lack of KV blocks"
    )
    num_load_rollbacks: int = metric(  # total
        "kvwise_kv_load_rollbacks", "loads from the tiers that came up short (recomputed)"
    )
    kv: KVCacheStats  # the device pool and the prefix cache
    store: StoreStats | None = None  # the tiers below the pool; None without tiers
    num_admission_skips: int = metric(  # total
        "kvwise_admission_skips",
        "requests admitted ahead of an older waiting request that did not fit the KV pool yet",
        default=0,
    )
    num_admission_aged: int = metric(  # total
        "kvwise_admission_aged",
        "waiting requests skipped max_admission_skips times: nothing behind them was admitted "
        "before them",
        default=0,
    )
    oldest_waiting_s: float = metric(
        "kvwise_oldest_waiting_seconds",
        "how long the longest-waiting request in the queue has waited (0 with none waiting)",
        GAUGE,
        default=0.0,
    )
    num_last_rows_reused: int = metric(  # total
        "kvwise_last_rows_reused",
        "prompts cached whole whose first token came from their kept last row (no model run)",
        default=0,
    )
    tool_pauses: int = metric(
        "kvwise_tool_pauses",
        "turns that ended in tool calls, their KV kept for the pause",
        default=0,
    )
    tool_resumes: int = metric(
        "kvwise_tool_resumes",
        "turns with a tool's result that extended a paused turn",
        default=0,
    )
    tool_resumed_device_tokens: int = metric(
        _RESUMED, _RESUMED_HELP, default=0, labels={"source": "device"}
    )
    tool_resumed_tier_tokens: int = metric(
        _RESUMED, _RESUMED_HELP, default=0, labels={"source": "tier"}
    )
    tool_recomputed_tokens: int = metric(
        _RESUMED, _RESUMED_HELP, default=0, labels={"source": "recomputed"}
    )
    num_generated_tokens: int = metric(  # total
        "kvwise_engine_generated_tokens",
        "tokens sampled, counted in the step that sampled them (the dashboard's tokens/s; "
        "kvwise_generation_tokens_total counts them when their request ends)",
        default=0,
    )
    kv_integrity_checks: int = metric(  # the async engine's
        "kvwise_kv_integrity_checks",
        "KV pool integrity checks passed while idle (a failure stops the engine)",
        default=0,
    )
    grammar_compiled: int = metric(
        _GRAMMAR, _GRAMMAR_HELP, default=0, labels={"outcome": "compiled"}
    )
    grammar_cached: int = metric(_GRAMMAR, _GRAMMAR_HELP, default=0, labels={"outcome": "cached"})
    grammar_invalid: int = metric(_GRAMMAR, _GRAMMAR_HELP, default=0, labels={"outcome": "invalid"})
    grammar_timeout: int = metric(_GRAMMAR, _GRAMMAR_HELP, default=0, labels={"outcome": "timeout"})
    grammar_cancelled: int = metric(
        _GRAMMAR, _GRAMMAR_HELP, default=0, labels={"outcome": "cancelled"}
    )
    grammar_busy: int = metric(_GRAMMAR, _GRAMMAR_HELP, default=0, labels={"outcome": "busy"})

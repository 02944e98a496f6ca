"""Prompt caching as the providers sell it, from the engine's counts (issue 46, item 2).

- ``cache_breakpoints``: a route's ``cache_control`` breakpoints (each: the conversation up to
  and including the marked block, and its TTL) as the engine's ``CacheBreakpoint``s: the
  tokens each prefix shares with the whole prompt (both tokenized by the engine, as
  ``add_request`` would, the prefix without the generation prompt).
- ``anthropic_usage``: Anthropic's ``usage`` of one ``RequestOutput``: ``input_tokens`` (the
  prompt's uncached rest), ``cache_read_input_tokens`` (read from the device pool or loaded
  from the tiers: ``num_cached_tokens``, automatic prefix caching included),
  ``cache_creation_input_tokens`` and its split by TTL (``cache_created_tokens``); the three
  input counts add up to the prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvwise.engine.client import EngineClient
from kvwise.engine.prompts import ChatPrompt, Prompt
from kvwise.types import CacheBreakpoint, RequestOutput

FIVE_MINUTES_S = 300.0  # cache_control {"type": "ephemeral"}
ONE_HOUR_S = 3600.0  # cache_control {"type": "ephemeral", "ttl": "1h"}


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def breakpoints_of(
    prompt_ids: Sequence[int], prefixes: Sequence[tuple[Sequence[int], float]]
) -> tuple[CacheBreakpoint, ...]:
    """Each ``(prefix ids, ttl_s)`` as a breakpoint over the tokens the prefix shares with
    ``prompt_ids`` (none where it shares none)."""
    points = []
    for prefix_ids, ttl_s in prefixes:
        num_tokens = common_prefix_len(prefix_ids, prompt_ids)
        if num_tokens:
            points.append(CacheBreakpoint(num_tokens, ttl_s))
    return tuple(points)


def _prefix_prompt(prefix: Prompt, tools: list[dict] | None) -> Prompt:
    """A conversation prefix as the engine renders it for a count: without the generation
    prompt (chat messages); other prompts as they are."""
    if isinstance(prefix, ChatPrompt):
        return ChatPrompt(prefix.messages, prefix.tools, add_generation_prompt=False)
    if isinstance(prefix, list) and prefix and isinstance(prefix[0], dict):
        return ChatPrompt(prefix, tools, add_generation_prompt=False)
    return prefix


async def cache_breakpoints(
    engine: EngineClient,
    prompt: Prompt,
    prefixes: Sequence[tuple[Prompt, float]],
    tenant: str,
    tools: list[dict] | None = None,
) -> tuple[CacheBreakpoint, ...]:
    """The engine's breakpoints for a request of ``prompt`` whose ``cache_control`` marks
    ``prefixes``: ``(conversation prefix, ttl_s)`` each (chat messages, rendered with
    ``tools`` like the prompt). Tokenizes on the engine's tokenizer threads.

    Raises:
        InvalidRequest: as ``EngineClient.tokenize``.
    """
    if not prefixes:
        return ()
    whole, *parts = await asyncio.gather(
        engine.tokenize(prompt, tenant),
        *(engine.tokenize(_prefix_prompt(p, tools), tenant) for p, _ in prefixes),
    )
    return breakpoints_of(whole, [(ids, ttl) for ids, (_, ttl) in zip(parts, prefixes)])


def cache_creation(out: RequestOutput) -> tuple[int, int]:
    """``(5 minute, 1 hour)`` tokens this request wrote under breakpoints: a TTL of an hour
    or more counts as 1h, a shorter one as 5m (Anthropic's two classes)."""
    created = out.cache_created_tokens
    one_hour = sum(n for ttl, n in created.items() if ttl >= ONE_HOUR_S)
    return sum(created.values()) - one_hour, one_hour


def anthropic_usage(out: RequestOutput, output_tokens: int | None = None) -> dict:
    """Anthropic's ``usage`` object of ``out`` (``output_tokens``: its generated tokens
    unless given, e.g. 0 or 1 in ``message_start``)."""
    five_min, one_hour = cache_creation(out)
    read = out.num_cached_tokens
    return {
        "input_tokens": max(0, out.num_prompt_tokens - read - five_min - one_hour),
        "output_tokens": len(out.token_ids) if output_tokens is None else output_tokens,
        "cache_creation_input_tokens": five_min + one_hour,
        "cache_read_input_tokens": read,
        "cache_creation": {
            "ephemeral_5m_input_tokens": five_min,
            "ephemeral_1h_input_tokens": one_hour,
        },
    }

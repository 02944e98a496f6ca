"""The server's side of cache breakpoints (kvwise/server/cache_usage.py): prefixes → token
counts through the engine's tokenizer, and Anthropic's usage, whose three input counts add up
to the prompt."""

import asyncio

from kvwise.engine.prompts import ChatPrompt
from kvwise.server.cache_usage import anthropic_usage, breakpoints_of, cache_breakpoints
from kvwise.types import CacheBreakpoint, RequestMetrics, RequestOutput


def output(num_prompt, cached, created, generated=3):
    return RequestOutput(
        "r",
        list(range(num_prompt)),
        "",
        list(range(generated)),
        [],
        True,
        None,
        num_prompt,
        cached,
        0,
        RequestMetrics(0.0),
        cache_created_tokens=created,
    )


def test_usage_adds_up_to_the_prompt():
    usage = anthropic_usage(output(3000, 1024, {300.0: 1500, 3600.0: 400}))
    assert usage == {
        "input_tokens": 76,
        "output_tokens": 3,
        "cache_creation_input_tokens": 1900,
        "cache_read_input_tokens": 1024,
        "cache_creation": {"ephemeral_5m_input_tokens": 1500, "ephemeral_1h_input_tokens": 400},
    }
    plain = anthropic_usage(output(100, 64, {}), output_tokens=1)
    assert (plain["input_tokens"], plain["cache_read_input_tokens"]) == (36, 64)
    assert plain["cache_creation_input_tokens"] == 0 and plain["output_tokens"] == 1


def test_breakpoints_cover_what_each_prefix_shares_with_the_prompt():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    # a prefix rendered with an end-of-turn token the prompt does not have there: cut at it
    got = breakpoints_of(prompt, [([1, 2, 3, 99], 3600.0), ([1, 2, 3, 4, 5, 6], 300.0), ([9], 300)])
    assert got == (CacheBreakpoint(3, 3600.0), CacheBreakpoint(6, 300.0))


class Engine:
    """Tokenizes chat messages to one id per message (then 0 for a generation prompt)."""

    def __init__(self) -> None:
        self.seen = []

    async def tokenize(self, prompt, tenant="default"):
        self.seen.append((prompt, tenant))
        if isinstance(prompt, ChatPrompt):
            ids = [len(m["content"]) for m in prompt.messages]
            return ids + ([0] if prompt.add_generation_prompt else [])
        return [len(m["content"]) for m in prompt] + [0]


def test_cache_breakpoints_tokenize_prefixes_without_the_generation_prompt():
    engine = Engine()
    messages = [{"role": "system", "content": "x" * 5}, {"role": "user", "content": "y" * 7}]
    got = asyncio.run(
        cache_breakpoints(engine, messages, [(messages[:1], 3600.0), (messages, 300.0)], "alice")
    )
    assert got == (CacheBreakpoint(1, 3600.0), CacheBreakpoint(2, 300.0))
    assert all(tenant == "alice" for _, tenant in engine.seen)
    assert [p.add_generation_prompt for p, _ in engine.seen[1:]] == [False, False]
    assert asyncio.run(cache_breakpoints(engine, messages, [], "alice")) == ()

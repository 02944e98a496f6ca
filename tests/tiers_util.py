"""Shared by the tier tests on the default model (tests/model, tests/integration)."""

from __future__ import annotations

from kvwise.types import RequestOptions, SamplingParams

PROMPT = "Here is a list of fruits and their colours. " + " ".join(
    f"Fruit number {i} is {'red' if i % 3 else 'yellow'}." for i in range(40)
)
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def run(engine, prompt=PROMPT, **kw):
    """Generate one prompt greedily to the end (``kw``: request options); return its final
    output."""
    request_id = engine.add_request(prompt, GREEDY, RequestOptions(**kw))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def evict_device(engine) -> None:
    """Flush the tiers and forget every cached block of the device pool: what is reused next
    can only come from a tier."""
    engine.flush()
    engine.kv_manager.pool.reset_prefix_cache()

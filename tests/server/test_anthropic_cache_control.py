"""cache_control honoured, through the official ``anthropic`` SDK on the default model
(issue 46, item 2): a system prompt of more than 2,000 tokens marked ``cache_control`` is
created by the first call (``cache_creation_input_tokens`` and
``cache_creation.ephemeral_5m_input_tokens`` = its whole blocks, no reads) and read by the
next (``cache_read_input_tokens``); a 5m breakpoint whose TTL (scaled to 3 s by
``cache_ttl_scale``) ran out is created again; a 1h one is still read after another tenant's
traffic went through a small pool, while a newer unmarked prefix went by LRU. Every usage's
three input counts add up to what count_tokens says of the same body."""

from __future__ import annotations

import time

import anthropic
import pytest

from kvwise.server import create_app
from tests.server.conftest import KEYS, LiveServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BS = 16
SYSTEM = " ".join(  # (tests/model/test_breakpoint_keeps.py's: 2,150 tokens as a system message)
    f"Rule {i}: the {['north', 'south', 'east', 'west'][i % 4]} gate of depot {i} opens at "
    f"{i % 24:02d}:{(7 * i) % 60:02d} and takes parcels under {10 + i % 30} kg."
    for i in range(72)
)


def serve(engine):
    return LiveServer(create_app(engine, api_keys=KEYS, model_name=MODEL))


def call(server, question, ttl=None, system=SYSTEM, key="key-alice"):
    """A message whose system prompt is marked with ``ttl`` ("5m", "1h"; None: unmarked).
    Returns its usage (checked against count_tokens)."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=300)
    block = {"type": "text", "text": system}
    if ttl is not None:
        block["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    body = {"model": MODEL, "system": [block], "messages": [{"role": "user", "content": question}]}
    usage = client.messages.create(max_tokens=2, extra_body={"temperature": 0}, **body).usage
    prompt = client.messages.count_tokens(**body).input_tokens
    read, created = usage.cache_read_input_tokens, usage.cache_creation_input_tokens
    assert usage.input_tokens + read + created == prompt
    five_min, one_hour = (
        usage.cache_creation.ephemeral_5m_input_tokens,
        usage.cache_creation.ephemeral_1h_input_tokens,
    )
    assert five_min + one_hour == created
    return usage


@pytest.fixture(scope="module")
def system_tokens(make_engine) -> int:
    """The system prompt's whole blocks (what a breakpoint on it keeps)."""
    from kvwise.engine.prompts import ChatPrompt

    engine = make_engine(kv_cache_memory="16MiB")
    n = len(engine.tokenize(ChatPrompt([{"role": "system", "content": SYSTEM}], None, False)))
    assert n >= 2000
    return n // BS * BS


def test_created_read_and_after_its_ttl_created_again(make_engine, system_tokens):
    with serve(make_engine(cache_ttl_scale=0.01)) as server:  # 5 minutes: 3 s
        first = call(server, "When does depot 7 open?", "5m")
        assert first.cache_read_input_tokens == 0
        assert first.cache_creation_input_tokens == system_tokens
        assert first.cache_creation.ephemeral_5m_input_tokens == system_tokens
        second = call(server, "Which gate of depot 12?", "5m")
        assert system_tokens <= second.cache_read_input_tokens <= system_tokens + BS
        assert second.cache_creation_input_tokens == 0
        time.sleep(3.5)
        third = call(server, "And depot 30?", "5m")
        assert third.cache_read_input_tokens == 0
        assert third.cache_creation.ephemeral_5m_input_tokens == system_tokens


def test_a_1h_breakpoint_is_read_after_traffic_filled_the_pool(make_engine, system_tokens):
    block_bytes = make_engine(kv_cache_memory="16MiB").runner.spec.block_bytes
    engine = make_engine(kv_cache_memory=200 * block_bytes, max_retained_fraction_per_tenant=0.9)
    with serve(engine) as server:  # 3,200 tokens
        first = call(server, "When does depot 7 open?", "1h")
        assert first.cache_creation.ephemeral_1h_input_tokens == system_tokens
        assert first.cache_creation.ephemeral_5m_input_tokens == 0
        plain = SYSTEM[:1500].replace("Rule", "Law")  # ~550 tokens, unmarked
        assert call(server, "And depot 3?", system=plain).cache_read_input_tokens == 0
        for i in range(2):  # then another tenant's traffic: 2 x ~650 tokens
            other = SYSTEM[i * 300 : i * 300 + 1800].replace("depot", f"hub{i}")
            call(server, "Summarise.", system=other, key="key-bob")
        again = call(server, "Which gate of depot 12?", "1h")
        assert again.cache_read_input_tokens >= system_tokens
        assert again.cache_creation_input_tokens == 0
        # the unmarked prefix, newer than the marked one, went by LRU
        assert call(server, "And depot 3?", system=plain).cache_read_input_tokens == 0

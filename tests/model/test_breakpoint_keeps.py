"""Cache breakpoints on the default model, through the engine's API (issue 46, item 2): a
system prompt of more than 2,000 tokens under a 5m breakpoint is created by the first request
and read by the next; a 1h one is still read after other traffic went through a small pool
(a plain prefix of the same traffic is not); a 5m one whose (scaled) TTL ran out is created
again, even with a host tier holding its blocks. The usage adds up to the prompt."""

import time

from kvwise.engine.prompts import ChatPrompt
from kvwise.server.cache_usage import anthropic_usage, breakpoints_of
from kvwise.types import RequestOptions, SamplingParams

P = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
BS = 16
SYSTEM = " ".join(
    f"Rule {i}: the {['north', 'south', 'east', 'west'][i % 4]} gate of depot {i} opens at "
    f"{i % 24:02d}:{(7 * i) % 60:02d} and takes parcels under {10 + i % 30} kg."
    for i in range(72)
)  # 2,160 tokens as the system message


def chat(system, question):
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def breakpoints(engine, messages, ttl_s):
    """A breakpoint on the system message, as the server converts one (common prefix of the
    prefix's tokens and the prompt's)."""
    prefix = engine.tokenize(ChatPrompt(messages[:1], add_generation_prompt=False))
    return breakpoints_of(engine.tokenize(messages), [(prefix, ttl_s)])


def run(engine, messages, ttl_s=None, tenant="alice"):
    bps = breakpoints(engine, messages, ttl_s) if ttl_s else ()
    options = RequestOptions(tenant=tenant, cache_breakpoints=bps)
    rid = engine.add_request(messages, P, options)
    result = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                result = out
    engine.check_integrity()
    usage = anthropic_usage(result)
    created = usage["cache_creation_input_tokens"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + created == (
        result.num_prompt_tokens
    )
    return usage, (bps[0].num_tokens if bps else 0)


def test_a_1h_breakpoint_is_read_after_traffic_filled_the_pool(make_engine):
    block_bytes = make_engine(kv_cache_memory="16MiB").runner.spec.block_bytes
    # 3,200 tokens, 90% of them keepable by one tenant
    engine = make_engine(kv_cache_memory=200 * block_bytes, max_retained_fraction_per_tenant=0.9)
    assert engine.kv_manager.num_blocks == 200
    first, prefix = run(engine, chat(SYSTEM, "When does depot 7 open?"), ttl_s=3600)
    assert first["cache_creation"]["ephemeral_1h_input_tokens"] == prefix // BS * BS
    plain = chat(SYSTEM[:1500].replace("Rule", "Law"), "And depot 3?")  # ~550 tokens, no keep
    assert run(engine, plain)[0]["cache_read_input_tokens"] == 0
    for i in range(2):  # then other traffic, another tenant's: 2 x ~650 tokens
        other = SYSTEM[i * 300 : i * 300 + 1800].replace("depot", f"hub{i}")
        run(engine, chat(other, "Summarise."), tenant="bob")
    again, _ = run(engine, chat(SYSTEM, "Which gate of depot 12?"), ttl_s=3600)
    assert again["cache_read_input_tokens"] > prefix - BS
    assert again["cache_creation_input_tokens"] == 0
    # the plain prefix, more recent than the kept one, went by LRU
    assert run(engine, plain)[0]["cache_read_input_tokens"] == 0


def test_a_5m_breakpoint_is_created_read_and_after_its_ttl_created_again(make_engine):
    # 5 minutes scaled to 3 s; a host tier holds the blocks after they leave the pool
    engine = make_engine(cache_ttl_scale=0.01, kv_host_memory="256MiB")
    try:
        first, prefix = run(engine, chat(SYSTEM, "When does depot 7 open?"), ttl_s=300)
        assert prefix >= 2000
        assert first["cache_read_input_tokens"] == 0
        assert first["cache_creation"]["ephemeral_5m_input_tokens"] == prefix // BS * BS
        assert first["cache_creation"]["ephemeral_1h_input_tokens"] == 0
        second, _ = run(engine, chat(SYSTEM, "Which gate of depot 12?"), ttl_s=300)
        assert prefix - BS < second["cache_read_input_tokens"] <= prefix + BS
        assert second["cache_creation_input_tokens"] == 0
        assert second["input_tokens"] < 40
        engine.store.flush()  # (the host tier holds them now)
        time.sleep(3.5)
        third, _ = run(engine, chat(SYSTEM, "And depot 30?"), ttl_s=300)
        assert third["cache_read_input_tokens"] == 0
        assert third["cache_creation"]["ephemeral_5m_input_tokens"] == prefix // BS * BS
        fourth, _ = run(engine, chat(SYSTEM, "And depot 31?"), ttl_s=300)
        assert fourth["cache_read_input_tokens"] > prefix - BS
    finally:
        engine.close()

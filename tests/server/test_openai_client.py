"""The official ``openai`` client against the real server on the default model (SmolLM2):
completions, chat, streaming, usage with cached tokens, tenant isolation end to end, and errors
as the client's exception types."""

from __future__ import annotations

import openai
import pytest

from tests.hits import whole_hit

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
DOC = " ".join(
    f"Note {i}: the {i}th bridge over the river was painted {c}."
    for i, c in enumerate(["red", "blue", "green", "white", "black", "gold"] * 2)
)
pytestmark = pytest.mark.slow


def full_blocks(num_prompt_tokens: int) -> int:
    """Tokens a repeat can take from the cache (the last token always computed)."""
    return whole_hit(num_prompt_tokens, BLOCK)


@pytest.fixture(scope="module")
def server(real_server):
    return real_server


def client_for(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def alice(server):
    return client_for(server, "key-alice")


@pytest.fixture(scope="module")
def bob(server):
    return client_for(server, "key-bob")


def test_models(alice):
    assert [m.id for m in alice.models.list().data] == [MODEL]


def test_completion(alice):
    r = alice.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert r.choices[0].text.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_and_streamed_chat_agree(alice):
    messages = [{"role": "user", "content": "Name one planet. One word."}]
    whole = alice.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and text.strip()
    stream = alice.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # the same prompt again: its full blocks come from the cache
    assert usage.prompt_tokens_details.cached_tokens == full_blocks(usage.prompt_tokens)


def test_cached_tokens_on_a_repeated_prompt(alice):
    messages = [
        {"role": "system", "content": "You answer questions about this list. " + DOC},
        {"role": "user", "content": "Which bridge was painted gold?"},
    ]
    first = alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    again = alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n = again.usage.prompt_tokens
    assert n > 4 * BLOCK and again.usage.prompt_tokens_details.cached_tokens == full_blocks(n)


def test_a_repeated_block_aligned_prompt_takes_its_first_token_from_the_kept_row(server, alice):
    """A token-id prompt of whole blocks, sent twice: the repeat is a whole hit whose first
    token comes from the kept last row, with the same token and logprob, counted in /metrics."""
    import httpx

    def reused() -> float:
        text = httpx.get(server.base_url + "/metrics",
                         headers={"Authorization": "Bearer key-alice"}).text  # fmt: skip
        (line,) = [x for x in text.splitlines() if x.startswith("kvwise_last_rows_reused_total")]
        return float(line.split()[-1])

    ids = [1000 + 37 * i % 9000 for i in range(4 * BLOCK)]
    before = reused()
    first, again = (alice.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0,
                                             logprobs=2) for _ in range(2))  # fmt: skip
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    assert reused() == before + 1
    assert again.choices[0].text == first.choices[0].text
    assert again.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs


def test_tenant_isolation_end_to_end(alice, bob):
    prompt = "Tenant isolation check. " + DOC

    def cached(client, **extra) -> tuple[int, int]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens

    assert cached(alice)[0] == 0
    # bob asks for alice's prompt, even naming her in the body: nothing of hers is visible
    assert cached(bob, user="alice", tenant="alice")[0] == 0
    hit, n = cached(alice)
    assert hit == full_blocks(n) > 0  # alice's repeat: every full block
    # a salt is a namespace within the tenant; prompt_cache_key never crosses tenants
    assert cached(alice, cache_salt="project-x")[0] == 0
    assert cached(alice, cache_salt="project-x")[0] == full_blocks(n)
    assert cached(bob, prompt_cache_key="alice-shared")[0] == full_blocks(n)  # bob's own blocks
    assert cached(alice, prompt_cache_retention="24h")[0] == full_blocks(n)


def test_errors_are_the_clients_exception_types(server, alice):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        alice.chat.completions.create(model=MODEL, messages=messages, n=17)
    assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        alice.chat.completions.create(model=MODEL, messages=[])
    assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        alice.chat.completions.create(model=MODEL, messages=messages, temperature=5)
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        alice.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=1)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    with pytest.raises(openai.NotFoundError) as info:
        alice.chat.completions.create(model="gpt-4o", messages=messages)
    assert info.value.param == "model"
    with pytest.raises(openai.AuthenticationError):
        client_for(server, "not-a-key").chat.completions.create(model=MODEL, messages=messages)
    with pytest.raises(openai.AuthenticationError):
        client_for(server, "not-a-key").models.list()


def test_no_blocks_leaked(server):
    assert server.engine.call_sync(lambda e: e.kv_manager.pool.num_used_blocks) == 0
    server.engine.call_sync(lambda e: e.check_integrity())

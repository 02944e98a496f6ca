"""Sampling parity through the official ``openai`` client on the default model: chat logprobs
and top_logprobs (sorted, complete, the same streamed), completions' logprobs with echo and
max_tokens=0 (what evaluation harnesses send), a list of prompts, n choices sharing their
prompt's blocks (one prefill: the later choices wait a step and hit the first one's blocks),
logit_bias, penalties and repetition_penalty passed through."""

from __future__ import annotations

import openai
import pytest

from tests.server.test_openai_client import DOC, MODEL, client_for, full_blocks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(real_server):
    return real_server


@pytest.fixture(scope="module")
def alice(server) -> openai.OpenAI:
    return client_for(server, "key-alice")


MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_chat_logprobs_sorted_complete_and_streamed_alike(alice):
    r = alice.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                      temperature=0, logprobs=True, top_logprobs=4)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 4 and t.logprob <= 0
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert t.top_logprobs[0].token == t.token and abs(values[0] - t.logprob) < 1e-6
        assert bytes(t.bytes).decode() == t.token
    streamed = []
    for chunk in alice.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                               temperature=0, logprobs=True, top_logprobs=4,
                                               stream=True):  # fmt: skip
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = alice.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_completion_echo_logprobs_and_max_tokens_zero(alice):
    prompt = "The capital of France is Paris. The capital of Italy is"
    zero = alice.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                    logprobs=2, temperature=0)  # fmt: skip
    choice = zero.choices[0]
    assert choice.text == prompt and zero.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == zero.usage.prompt_tokens and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    one = alice.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                   logprobs=2, temperature=0)  # fmt: skip
    both = one.choices[0].logprobs
    assert both.token_logprobs[: len(lp.tokens)] == lp.token_logprobs
    assert len(both.tokens) == len(lp.tokens) + 1 and one.choices[0].text.startswith(prompt)
    assert " Rome" in one.choices[0].text


def test_a_list_of_prompts_and_n_choices(alice):
    r = alice.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], n=3,
                                 max_tokens=4, temperature=0)  # fmt: skip
    assert [c.index for c in r.choices] == list(range(6))
    texts = [c.text for c in r.choices]
    assert texts[0] == texts[1] == texts[2] and texts[3] == texts[4] == texts[5]
    assert texts[0] != texts[3]
    assert r.usage.completion_tokens == 24
    sampled = alice.completions.create(model=MODEL, prompt="Once upon a time", n=4, max_tokens=12,
                                       temperature=1.0, seed=7)  # fmt: skip
    assert len({c.text for c in sampled.choices}) > 1  # each choice its own draw


def test_n_choices_share_one_prefill(server, alice):
    """However the choices arrive (the later ones wait for the first one's prefill, or find it
    done), the prompt is computed once: the other three hit its blocks."""
    hits = lambda e: e.kv_manager.num_prefix_hit_tokens  # noqa: E731
    before = server.engine.call_sync(hits)
    messages = [{"role": "user", "content": DOC + " Which colours were used twice?"}]
    r = alice.chat.completions.create(model=MODEL, messages=messages, n=4, max_tokens=4,
                                      temperature=0.8, seed=3)  # fmt: skip
    assert len(r.choices) == 4
    cold = r.usage.prompt_tokens_details.cached_tokens  # the first choice's: the system prompt
    assert cold < full_blocks(r.usage.prompt_tokens)
    shared = server.engine.call_sync(hits) - before - cold
    assert shared == 3 * full_blocks(r.usage.prompt_tokens)
    assert server.engine.call_sync(lambda e: e.kv_manager.pool.num_used_blocks) == 0


def test_logit_bias_and_penalties(alice):
    r = alice.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                 logit_bias={"42": 100})  # fmt: skip
    assert r.choices[0].text == alice.completions.create(
        model=MODEL, prompt=[[42, 42, 42]], max_tokens=0, echo=True).choices[0].text  # fmt: skip
    prompt = "one two one two one two one two"
    plain = alice.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"extra_body": {"repetition_penalty": 5.0}}):  # fmt: skip
        other = alice.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0, **extra)  # fmt: skip
        assert other.choices[0].text != plain.choices[0].text, extra

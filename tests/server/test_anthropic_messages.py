"""Anthropic's Messages API through the official ``anthropic`` SDK on the default model
(``real_server``: API keys, so the SDK's ``x-api-key`` names the tenant): a greedy message
equals what /v1/chat/completions answers for the same conversation; a stream sends
Anthropic's event sequence and joins to the same text; stop sequences; a forced tool call
and the tool result's turn (which reads the call turn's blocks from the cache);
count_tokens; tenants; the 400s and the 401 in Anthropic's error shape; /tokenize and
/detokenize."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import anthropic
import httpx
import pytest

from tests.server.test_openai_client import BLOCK, MODEL, client_for
from tests.server.test_openai_tools import PROMPTS, TOOLS, _valid

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}  # the SDK no longer sends temperature: the body carries it
SYSTEM = "You are a concise assistant."
QUESTION = "Name three colours of the rainbow."
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}


@pytest.fixture(scope="module")
def server(real_server):
    return real_server


def sdk(server, key: str = "key-alice") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def alice(server) -> anthropic.Anthropic:
    return sdk(server)


@pytest.fixture(scope="module")
def answer(alice):
    """The greedy answer to SYSTEM + QUESTION in 12 tokens."""
    return alice.messages.create(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": QUESTION}],
    )


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_message_is_what_chat_completions_answers(server, answer):
    chat = client_for(server, "key-alice").chat.completions.create(
        model=MODEL,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )
    assert answer.id.startswith("msg_") and answer.type == "message"
    assert answer.role == "assistant" and answer.model == MODEL
    [block] = answer.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert answer.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert answer.stop_sequence is None
    usage = answer.usage
    assert usage.output_tokens == chat.usage.completion_tokens
    assert prompt_tokens(usage) == chat.usage.prompt_tokens
    assert usage.cache_creation_input_tokens == 0
    assert usage.cache_creation.ephemeral_5m_input_tokens == 0
    assert usage.cache_creation.ephemeral_1h_input_tokens == 0


def raw_events(server, body: dict) -> list[dict]:
    """A stream's events as sent (the SDK drops pings): each ``event:`` line's type checked
    against its data's."""
    headers = {"x-api-key": "key-alice", "anthropic-version": "2023-06-01"}
    reply = httpx.post(
        server.base_url + "/v1/messages", headers=headers, timeout=60, json={**body, "stream": True}
    )
    assert reply.status_code == 200 and reply.headers["content-type"].startswith(
        "text/event-stream"
    )
    events = []
    for chunk in reply.text.split("\n\n"):
        if chunk:
            kind, data = chunk.split("\n")
            events.append(json.loads(data.removeprefix("data: ")))
            assert kind == "event: " + events[-1]["type"]
    return events


def test_a_stream_sends_anthropics_events_and_the_same_text(server, alice, answer):
    kwargs = dict(
        model=MODEL, max_tokens=12, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    events = raw_events(server, {**kwargs, **GREEDY})
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start, delta = events[0]["message"], events[-2]
    assert start["id"].startswith("msg_") and start["content"] == [] and not start["stop_reason"]
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == (
        prompt_tokens(answer.usage)
    )
    assert delta["delta"]["stop_reason"] == answer.stop_reason
    assert delta["usage"]["output_tokens"] == answer.usage.output_tokens
    assert events[2]["content_block"] == {"type": "text", "text": ""}
    text = "".join(e["delta"]["text"] for e in events[3:-3])
    assert text == answer.content[0].text
    with alice.messages.stream(extra_body=GREEDY, **kwargs) as stream:  # the SDK's own reading
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text == final.content[0].text
    assert final.stop_reason == answer.stop_reason
    assert final.usage.output_tokens == answer.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(answer.usage)


def test_a_stop_sequence_is_named(alice, answer):
    text = answer.content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = alice.messages.create(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        extra_body=GREEDY,
        stop_sequences=[stop],
        messages=[{"role": "user", "content": QUESTION}],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    got = cut.content[0].text if cut.content else ""
    assert got == text[: text.index(stop)]  # the text up to the stop sequence, without it


def test_a_prefill_is_continued(server, alice):
    """A last assistant message is continued, as /v1/completions continues the rendered chat
    with that text after the assistant's header."""
    headers = {"Authorization": "Bearer key-alice"}
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = httpx.post(server.base_url + "/tokenize", headers=headers, json={"messages": chat})
    text = httpx.post(
        server.base_url + "/detokenize", headers=headers, json={"tokens": ids.json()["tokens"]}
    ).json()["prompt"]
    prefill = "The three colours I pick are"
    completion = client_for(server, "key-alice").completions.create(
        model=MODEL, prompt=text + prefill, max_tokens=8, temperature=0
    )
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": prefill}]
    message = alice.messages.create(
        model=MODEL, max_tokens=8, system=SYSTEM, messages=messages, extra_body=GREEDY
    )
    assert message.content[0].text == completion.choices[0].text
    assert prompt_tokens(message.usage) == completion.usage.prompt_tokens
    counted = alice.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    assert counted.input_tokens == completion.usage.prompt_tokens


def test_count_tokens_is_the_prompt_a_message_runs(alice, answer):
    counted = alice.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == prompt_tokens(answer.usage)


def test_a_forced_tool_call_and_its_result(server, alice):
    question = {"role": "user", "content": "What is the weather like in Paris?"}
    forced = {"type": "tool", "name": "get_weather"}
    first = alice.messages.create(
        model=MODEL,
        max_tokens=48,
        tools=[WEATHER],
        tool_choice=forced,
        messages=[question],
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use", first
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert isinstance(call.input["city"], str) and call.input["unit"] in ("celsius", "fahrenheit")
    with alice.messages.stream(
        model=MODEL,
        max_tokens=48,
        tools=[WEATHER],
        tool_choice=forced,
        messages=[question],
        extra_body=GREEDY,
    ) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and "input_json" in kinds  # input_json_delta
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", "get_weather", call.input)
    ]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees, sunny"}
    second = alice.messages.create(
        model=MODEL,
        max_tokens=16,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        extra_body=GREEDY,
        messages=[
            question,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ],
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text.strip()
    previous = prompt_tokens(first.usage) + first.usage.output_tokens
    assert prompt_tokens(second.usage) > previous
    assert second.usage.cache_read_input_tokens >= previous - BLOCK  # the call turn's blocks


def test_any_tool_choice_makes_a_valid_call_on_twenty_prompts(alice):
    """tool_choice any (and one call: disable_parallel_tool_use) on the twenty prompts of the
    OpenAI tools test: each answer is one tool_use block whose input validates."""
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    choice = {"type": "any", "disable_parallel_tool_use": True}

    def ask(prompt):
        return alice.messages.create(
            model=MODEL,
            max_tokens=96,
            tools=tools,
            tool_choice=choice,
            extra_body=GREEDY,
            messages=[{"role": "user", "content": prompt}],
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch in the engine
        answers = list(pool.map(ask, PROMPTS))
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer.stop_reason == "tool_use", (prompt, answer.content)
        [call] = answer.content
        as_openai = SimpleNamespace(
            function=SimpleNamespace(name=call.name, arguments=json.dumps(call.input))
        )
        assert any(_valid(as_openai, t) for t in TOOLS), (prompt, call)


def test_tenants_never_read_each_others_cache(server, alice):
    body = dict(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Tenants? " * 40}])
    alice.messages.create(**body)
    again = alice.messages.create(**body)
    bob = sdk(server, "key-bob").messages.create(**body)
    assert again.usage.cache_read_input_tokens >= BLOCK
    assert bob.usage.cache_read_input_tokens == 0
    assert prompt_tokens(bob.usage) == prompt_tokens(again.usage)


def _error(excinfo) -> dict:
    body = excinfo.value.body
    assert body["type"] == "error", body
    return body["error"]


def test_breakpoints_past_four_are_refused(alice):
    def system(ttls):
        return [
            {
                "type": "text",
                "text": f"Part {i}.",
                "cache_control": {"type": "ephemeral", "ttl": ttl},
            }
            for i, ttl in enumerate(ttls)
        ]

    ok = alice.messages.create(
        model=MODEL,
        max_tokens=1,
        system=system(["1h", "1h", "5m", "5m"]),
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert ok.type == "message"
    with pytest.raises(anthropic.BadRequestError) as five:
        alice.messages.create(
            model=MODEL,
            max_tokens=1,
            system=system(["5m"] * 5),
            messages=[{"role": "user", "content": "Hi"}],
        )
    error = _error(five)
    assert error["type"] == "invalid_request_error" and "maximum of 4" in error["message"]
    with pytest.raises(anthropic.BadRequestError) as automatic:  # the top-level one counts
        alice.messages.create(
            model=MODEL,
            max_tokens=1,
            system=system(["5m"] * 4),
            cache_control={"type": "ephemeral"},
            messages=[{"role": "user", "content": "Hi"}],
        )
    assert "found 5" in _error(automatic)["message"]
    with pytest.raises(anthropic.BadRequestError) as order:
        alice.messages.create(
            model=MODEL,
            max_tokens=1,
            system=system(["5m", "1h"]),
            messages=[{"role": "user", "content": "Hi"}],
        )
    assert "longer TTLs first" in _error(order)["message"]


def test_an_unknown_block_type_is_a_400(alice):
    image = {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as excinfo:
        alice.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}
            ],
        )
    error = _error(excinfo)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("messages[0].content[1].type: ")
    assert "'image'" in error["message"]


def test_bad_bodies_and_keys(server):
    url = server.base_url + "/v1/messages"
    headers = {"x-api-key": "key-alice", "anthropic-version": "2023-06-01"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    missing = httpx.post(url, headers=headers, json=body)
    assert missing.status_code == 400
    assert missing.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    bad_role = {**body, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}
    refused = httpx.post(url, headers=headers, json=bad_role).json()
    assert refused["error"]["message"].startswith("messages[0].role: ")
    with pytest.raises(anthropic.AuthenticationError) as excinfo:
        sdk(server, "key-mallory").messages.create(
            model=MODEL, max_tokens=1, messages=body["messages"]
        )
    assert _error(excinfo)["type"] == "authentication_error"


def test_tokenize_and_detokenize(server):
    headers = {"Authorization": "Bearer key-alice"}
    base = server.base_url
    text = "Prompt caching, the way providers sell it."
    assert httpx.post(base + "/tokenize", json={"prompt": text}).status_code == 401
    tokens = httpx.post(base + "/tokenize", headers=headers, json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 2048
    back = httpx.post(base + "/detokenize", headers=headers, json={"tokens": tokens["tokens"]})
    assert back.json() == {"prompt": text}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    chat = httpx.post(base + "/tokenize", headers=headers, json={"messages": messages}).json()
    usage = (
        client_for(server, "key-alice")
        .chat.completions.create(model=MODEL, max_tokens=1, messages=messages)
        .usage
    )
    assert chat["count"] == usage.prompt_tokens
    bare = {"messages": messages, "add_generation_prompt": False}
    assert (
        httpx.post(base + "/tokenize", headers=headers, json=bare).json()["count"] < chat["count"]
    )
    bad = httpx.post(base + "/detokenize", headers=headers, json={"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"

"""Anthropic's Messages requests as the engine's chat prompt (system, text, tool_use and
tool_result blocks, tools), their cache_control breakpoints (prefixes in prompt order with
their TTLs; a 5th or a 1h after a 5m refused), the 400s naming the field, and a streamed
answer as Anthropic's events (text, a tool call's input piece by piece, stop sequences). No
model, no server."""

from __future__ import annotations

import json

import pytest

from kvwise.engine.prompts import ChatPrompt
from kvwise.errors import InvalidRequest
from kvwise.server.anthropic_outputs import MessageEvents, message_of
from kvwise.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvwise.types import FinishReason, RequestMetrics, RequestOutput

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


def request(**body) -> MessagesRequest:
    body.setdefault("max_tokens", 8)
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    req = MessagesRequest.model_validate(body)
    req.check_supported()
    return req


def test_a_conversation_with_tools_as_chat_messages():
    req = request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "no"},
                            {"type": "text", "text": "data"},
                        ],
                    },
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
    )
    prompt = req.prompt_of()
    assert isinstance(prompt, ChatPrompt) and prompt.add_generation_prompt
    assert prompt.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    assert prompt.messages == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1", "name": "get_weather"},
        {
            "role": "tool",
            "content": "Error: no\n\ndata",
            "tool_call_id": "toolu_2",
            "name": "get_weather",
        },
        {"role": "user", "content": "Thanks."},
    ]
    assert req.tool_names() == {"get_weather"}
    assert request(messages=[{"role": "user", "content": "Hi"}]).prompt_of() == [
        {"role": "user", "content": "Hi"}
    ]


def test_a_last_assistant_message_is_continued():
    question = {"role": "user", "content": "Q?"}
    prompt = request(messages=[question, {"role": "assistant", "content": "The answer is"}])
    continued = prompt.prompt_of()
    assert isinstance(continued, ChatPrompt) and continued.continue_final_message
    assert continued.messages == [question, {"role": "assistant", "content": "The answer is"}]
    empty = request(messages=[question, {"role": "assistant", "content": []}])
    assert empty.prompt_of() == [question]  # the answer's turn opens as without it
    with pytest.raises(InvalidRequest, match=r"^messages\[1\]\.content: final .* whitespace"):
        request(messages=[question, {"role": "assistant", "content": "The answer is "}])
    call = {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}
    with pytest.raises(InvalidRequest, match=r"^messages\[1\]\.content: .* tool_use"):
        request(tools=[WEATHER], messages=[question, {"role": "assistant", "content": [call]}])


def test_sampling_and_forced_calls():
    params = request(temperature=0, top_k=5, stop_sequences=["END"]).sampling_params(99)
    assert (params.max_tokens, params.temperature, params.top_k, params.stop) == (8, 0, 5, ("END",))
    assert params.structured is None and request().sampling_params(99).temperature == 1.0
    forced = request(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    structured = forced.sampling_params(8).structured
    assert structured.kind == "grammar" and structured.field == "tools[0].input_schema"
    assert "get_weather" in structured.value
    assert request(tools=[WEATHER], tool_choice={"type": "none"}).tool_names() == set()
    assert request(tools=[WEATHER]).sampling_params(8).structured is None  # auto


def _breakpoints(**body) -> list[tuple[ChatPrompt, float]]:
    return request(**body).cache_breakpoint_prefixes()


def test_breakpoints_are_prefixes_in_prompt_order():
    prefixes = _breakpoints(
        tools=[{**WEATHER, "cache_control": HOUR}],
        system=[
            {"type": "text", "text": "S1", "cache_control": HOUR},
            {"type": "text", "text": "S2"},
        ],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "A", "cache_control": EPHEMERAL},
                    {"type": "text", "text": "B"},
                ],
            },
            {"role": "assistant", "content": "C"},
            {"role": "user", "content": "D"},
        ],
        cache_control=EPHEMERAL,  # the last block: D
    )
    assert [ttl for _, ttl in prefixes] == [3600.0, 3600.0, 300.0, 300.0]
    assert all(not p.add_generation_prompt for p, _ in prefixes)
    tools, system, first, last = (p for p, _ in prefixes)
    assert tools.messages == [{"role": "system", "content": "S1\n\nS2"}] and len(tools.tools) == 1
    assert system.messages == [{"role": "system", "content": "S1"}] and system.tools
    assert first.messages[1:] == [{"role": "user", "content": "A"}]
    assert (
        last.messages
        == request(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                },
                {"role": "assistant", "content": "C"},
                {"role": "user", "content": "D"},
            ],
            system="S1\n\nS2",
        ).engine_messages()
    )
    # a tool's breakpoint with no system prompt: an empty user turn makes it render
    [(only, ttl)] = _breakpoints(tools=[{**WEATHER, "cache_control": EPHEMERAL}])
    assert only.messages == [{"role": "user", "content": ""}] and ttl == 300.0
    # the top-level breakpoint on a block that has one already is that one
    assert (
        len(
            _breakpoints(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x", "cache_control": HOUR}],
                    }
                ],
                cache_control=EPHEMERAL,
            )
        )
        == 1
    )
    assert _breakpoints() == []


def test_breakpoint_limits():
    five = [{"type": "text", "text": f"{i}", "cache_control": EPHEMERAL} for i in range(5)]
    with pytest.raises(InvalidRequest, match="^cache_control: a maximum of 4 .* found 5"):
        request(system=five)
    with pytest.raises(InvalidRequest, match="found 5"):
        request(system=five[:4], cache_control=EPHEMERAL)
    late_hour = [five[0], {"type": "text", "text": "x", "cache_control": HOUR}]
    with pytest.raises(InvalidRequest, match=r"ttl='1h' breakpoint \(system\[1\]\) .* first"):
        request(system=late_hour)
    with pytest.raises(InvalidRequest, match="ttl='1h'"):  # the top-level one after a 5m
        request(system=five[:1], cache_control=HOUR)
    bad_ttl = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]
    with pytest.raises(InvalidRequest, match=r"^system\[0\]\.cache_control\.ttl: "):
        request(system=bad_ttl)


@pytest.mark.parametrize(
    "body, field",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            r"messages\[0\]\.content\[0\]\.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ]
            },
            r"messages\[0\]\.content\[0\]\.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image"}],
                            }
                        ],
                    }
                ]
            },
            r"messages\[0\]\.content\[0\]\.content\[0\]\.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            r"messages\[0\]\.content\[0\]\.text",
        ),
        ({"system": [{"type": "text", "text": 3}]}, r"system\[0\]\.text"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, r"tools\[0\]\.input_schema"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ],
)
def test_bad_fields_are_named(body, field):
    with pytest.raises(InvalidRequest, match=f"^{field}: "):
        request(**body)


def test_bad_stop_sequences_are_named():
    with pytest.raises(InvalidRequest, match="^stop_sequences: "):
        request(stop_sequences=[""]).sampling_params(8)
    counted = CountTokensRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    counted.check_supported()
    assert counted.prompt_of() == [{"role": "user", "content": "x"}]


def _out(delta: str, text: str, n: int, finish: FinishReason | None = None, stop=None):
    return RequestOutput(
        request_id="msg_1",
        prompt_token_ids=[],
        text=text,
        token_ids=list(range(n)),
        logprobs=[],
        finished=finish is not None,
        finish_reason=finish,
        num_prompt_tokens=40,
        num_cached_tokens=32,
        num_kv_rows_projected=0,
        metrics=RequestMetrics(0.0),
        delta_text=delta,
        stop_string=stop,
    )


def _events(stream: str) -> list[dict]:
    events = []
    for chunk in stream.split("\n\n"):
        if chunk:
            kind, data = chunk.split("\n")
            events.append(json.loads(data.removeprefix("data: ")))
            assert kind == f"event: {events[-1]['type']}"
    return events


def test_a_stream_of_text_ends_with_the_stop_sequence():
    stream = MessageEvents("msg_1", "m", set(), on_tool_use=lambda: None)
    pieces = [
        stream.on_output(0, _out("Hel", "Hel", 1)),
        stream.on_output(0, _out("lo", "Hello", 2, FinishReason.STOP, stop="!")),
    ]
    events = _events("".join(pieces))
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["usage"]["input_tokens"] == 8 and start["usage"]["cache_read_input_tokens"] == 32
    assert [e["delta"]["text"] for e in events[3:5]] == ["Hel", "lo"]
    assert events[6]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "!"}
    assert events[6]["usage"]["output_tokens"] == 2
    whole = message_of(_out("", "Hello", 2, FinishReason.STOP, stop="!"), "msg_1", "m", set())
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "!")
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == 40


def test_a_streamed_call_is_a_tool_use_block_with_its_input_in_pieces():
    paused = []
    stream = MessageEvents("msg_1", "m", {"get_weather"}, on_tool_use=lambda: paused.append(1))
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    cuts = [0, 12, 40, 55, len(answer)]
    events = []
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        finish = FinishReason.STOP if b == len(answer) else None
        events += _events(stream.on_output(0, _out(answer[a:b], answer[:b], k + 1, finish)) or "")
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    block = events[2]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["id"].startswith("toolu_") and block["input"] == {}
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and paused == [1]
    whole = message_of(_out("", answer, 4, FinishReason.STOP), "msg_1", "m", {"get_weather"})
    assert whole.stop_reason == "tool_use"
    assert [(c.type, c.input) for c in whole.content] == [("tool_use", {"city": "Paris"})]


def test_a_call_cut_by_max_tokens_is_a_truncated_tool_use_block():
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    out = _out(answer, answer, 9, FinishReason.LENGTH)
    whole = message_of(out, "msg_1", "m", {"get_weather"})
    assert whole.stop_reason == "max_tokens"
    assert [(c.type, c.name, c.input) for c in whole.content] == [("tool_use", "get_weather", {})]
    stream = MessageEvents("msg_1", "m", {"get_weather"}, on_tool_use=lambda: None)
    events = _events(stream.on_output(0, out))
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == [
        "tool_use"
    ]
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(pieces) == '{"city": "Pa'  # the input's text so far
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


def test_an_engine_error_mid_stream_ends_with_an_error_event():
    from fastapi.testclient import TestClient

    from kvwise.engine.async_engine import AsyncEngine
    from kvwise.server.app import create_app
    from tests.fakes import ControlledRunner, fake_engine

    engine = AsyncEngine(fake_engine(wrap_runner=ControlledRunner))
    runner = engine.engine.runner
    body = {"max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with TestClient(create_app(engine, api_keys={"k": "alice"})) as client:
            runner.fail_step(after=2)
            reply = client.post("/v1/messages", json=body, headers={"x-api-key": "k"})
            events = _events(reply.text)
            assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
            assert events[-1] == {
                "type": "error",
                "error": {"type": "api_error", "message": events[-1]["error"]["message"]},
            }
            assert "step failed on purpose" in events[-1]["error"]["message"]
            assert "[DONE]" not in reply.text
            no_key = client.post("/v1/messages", json=body)
            assert no_key.status_code == 401
            assert no_key.json()["error"]["type"] == "authentication_error"
    finally:
        engine.shutdown()

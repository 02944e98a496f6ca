"""OpenAI's Responses API through the official ``openai`` client on the default model
(SmolLM2): ``responses.create`` answers what chat answers for the same conversation (greedy),
``responses.stream`` sends the Responses events in order (deltas join to the text, the last
event carries usage), a function tool round trip through ``previous_response_id`` sends only
the tool's output and reads the first turn from the prefix cache, GET and DELETE of stored
responses, another tenant's id is the same 404 as one that never existed, bad input is a 400
naming the field, and the OpenAI Agents SDK on its default API (Responses) runs a two-tool
agent to completion."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.hits import whole_hit
from tests.server.test_openai_client import BLOCK, MODEL, client_for

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(real_server):
    return real_server


@pytest.fixture(scope="module")
def alice(server) -> openai.OpenAI:
    return client_for(server, "key-alice")


@pytest.fixture(scope="module")
def bob(server) -> openai.OpenAI:
    return client_for(server, "key-bob")


def _post(server, body: dict, key: str = "key-alice") -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/responses",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {key}"},
    )


def test_create_answers_as_chat_does(server, alice):
    chat = alice.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=24,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": QUESTION},
        ],
    )
    raw = _post(
        server,
        {
            "model": MODEL,
            "instructions": INSTRUCTIONS,
            "input": QUESTION,
            "temperature": 0,
            "max_output_tokens": 24,
            "metadata": {"k": "v"},
        },
    )
    assert raw.status_code == 200, raw.text
    r = Response.model_validate(raw.json())  # the SDK's type, every required field present
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text" and r.output[0].role == "assistant"
    finished = chat.choices[0].finish_reason
    assert r.status == ("completed" if finished == "stop" else "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= whole_hit(r.usage.input_tokens, BLOCK)
    assert r.instructions == INSTRUCTIONS and r.temperature == 0 and r.store is True
    assert r.metadata == {"k": "v"} and r.max_output_tokens == 24 and r.tools == []
    short = alice.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    assert short.status == "incomplete" and short.usage.output_tokens == 2
    assert short.incomplete_details.reason == "max_output_tokens"


def test_stream_sends_the_events_in_order(alice):
    kwargs = {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": QUESTION,
        "temperature": 0,
        "max_output_tokens": 16,
    }
    whole = alice.responses.create(**kwargs)
    with alice.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text
    if last == "response.completed":
        assert final.output_text == deltas
    done = events[-1].response
    assert done.status == whole.status and done.usage.output_tokens == whole.usage.output_tokens
    assert done.usage.input_tokens == whole.usage.input_tokens
    assert done.output[0].content[0].text == deltas


def test_a_function_tool_round_trip_through_previous_response_id(server, alice):
    before = server.engine.stats()
    first = alice.responses.create(
        model=MODEL,
        input="What is the weather like in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=96,
        parallel_tool_calls=False,
    )
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    second = alice.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=24,
        input=[
            {
                "type": "function_call_output",
                "call_id": calls[0].call_id,
                "output": '{"temperature": 21, "sky": "clear"}',
            }
        ],
    )
    assert second.previous_response_id == first.id and second.output_text is not None
    turn1 = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > turn1
    cached = second.usage.input_tokens_details.cached_tokens
    # the engine counts full blocks: all of turn 1's prompt, and its answer but its last block
    assert cached >= first.usage.input_tokens // BLOCK * BLOCK
    assert cached >= turn1 - BLOCK, (cached, turn1)
    after = server.engine.stats()  # the call turn paused for the tool, the next one resumed it
    assert after.tool_pauses >= before.tool_pauses + 1
    assert after.tool_resumes >= before.tool_resumes + 1


def test_a_streamed_call_is_the_same_call(alice):
    kwargs = {
        "model": MODEL,
        "input": "What is the weather like in Oslo?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 96,
    }
    whole = alice.responses.create(**kwargs)
    with alice.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    calls = [item for item in final.output if item.type == "function_call"]
    for call in calls:  # each call's arguments as the model writes them, not in one piece
        pieces = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.item_id == call.id
        ]
        assert len(pieces) >= 4 and "".join(pieces) == call.arguments
    assert events[-3].arguments == calls[-1].arguments
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c.name, json.loads(c.arguments)) for c in whole.output if c.type == "function_call"
    ]


def _raw_events(server, body: dict) -> list[dict]:
    """A stream's events as sent (each ``event:`` line naming its data's type)."""
    with httpx.stream(
        "POST",
        server.base_url + "/v1/responses",
        json={**body, "stream": True},
        headers={"Authorization": "Bearer key-alice"},
        timeout=120,
    ) as r:
        lines = list(r.iter_lines())
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [line[7:] for line in lines if line.startswith("event: ")] == [e["type"] for e in events]
    return events


def test_every_event_is_the_sdks_type_and_a_cut_call_is_incomplete(server):
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    cut = {
        "model": MODEL,
        "input": "Weather in Lima?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 12,
    }
    for body in ({"model": MODEL, "input": QUESTION, "max_output_tokens": 3}, cut):
        events = _raw_events(server, body)
        for event in events:
            adapter.validate_python(event)  # strictly: every required field, typed
        assert events[-1]["type"] == "response.incomplete"
        response = events[-1]["response"]
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        assert response["output"][-1]["status"] == "incomplete"
    call = response["output"][-1]  # cut inside its arguments: a truncated call, not prose
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert [item["type"] for item in response["output"]] == ["function_call"]


def test_text_format_json_schema(alice):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = alice.responses.create(
        model=MODEL,
        input="Name the capital of Italy as JSON.",
        temperature=0,
        max_output_tokens=32,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    assert r.status == "completed" and r.text.format.type == "json_schema"
    assert set(json.loads(r.output_text)) == {"city"}


def test_prompt_cache_key_and_retention_as_on_chat(server):
    """carol: a tenant of this test alone (the session's server keeps other tests' prefixes,
    and retention is capped per tenant)."""
    carol = client_for(server, "key-carol")

    def kept() -> int:
        return server.engine.call_sync(lambda e: e.kv_manager.pool.num_retained.get("carol", 0))

    assert kept() == 0
    r = carol.responses.create(
        model=MODEL,
        input="Keep this conversation a day. " * 8,
        max_output_tokens=2,
        prompt_cache_retention="24h",
        prompt_cache_key="resp-conv-1",
    )
    assert r.prompt_cache_retention == "24h" and r.prompt_cache_key == "resp-conv-1"
    assert kept() > 0  # its prefix is kept, as chat's 24h
    park = server.base_url + "/v1/kvwise/park"
    body = {"prompt_cache_key": "resp-conv-1"}  # the key names the engine session, per tenant
    as_carol = httpx.post(park, json=body, headers={"Authorization": "Bearer key-carol"})
    as_bob = httpx.post(park, json=body, headers={"Authorization": "Bearer key-bob"})
    assert as_carol.status_code == 200 and as_bob.status_code == 404


def test_get_and_delete(server, alice):
    r = alice.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0)
    got = alice.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    deleted = httpx.delete(
        f"{server.base_url}/v1/responses/{r.id}", headers={"Authorization": "Bearer key-alice"}
    )
    assert deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        alice.responses.create(model=MODEL, input="again", previous_response_id=r.id)
    assert info.value.param == "previous_response_id"
    unstored = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)


def test_another_tenants_response_is_a_404_like_none(server, alice, bob):
    r = alice.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0)
    url = f"{server.base_url}/v1/responses/{r.id}"
    as_bob = httpx.get(url, headers={"Authorization": "Bearer key-bob"})
    continued = _post(
        server, {"model": MODEL, "input": "more", "previous_response_id": r.id}, key="key-bob"
    )
    deleted_by_bob = httpx.delete(url, headers={"Authorization": "Bearer key-bob"})
    assert alice.responses.retrieve(r.id).id == r.id  # still alice's
    alice.responses.delete(r.id)
    gone = httpx.get(url, headers={"Authorization": "Bearer key-alice"})
    gone_continued = _post(server, {"model": MODEL, "input": "more", "previous_response_id": r.id})
    assert as_bob.status_code == gone.status_code == deleted_by_bob.status_code == 404
    assert as_bob.content == gone.content == deleted_by_bob.content  # the very same body
    assert continued.status_code == gone_continued.status_code == 404
    assert continued.content == gone_continued.content
    assert continued.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"truncation": "auto"}, "truncation"),
        ({"model": "gpt-5"}, "model"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": "word " * 3000}, "input"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
            "tools[0].parameters",
        ),
        ({"previous_response_id": ""}, "previous_response_id"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, extra, param):
    r = _post(server, {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra})
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_the_agents_sdk_runs_a_two_tool_agent_on_responses(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(f"weather:{city}")
        return f"It is 21 degrees and sunny in {city}."

    @agents.function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        called.append(f"time:{city}")
        return "It is 14:05."

    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="key-alice")
    provider = agents.OpenAIProvider(openai_client=client)  # its default API: Responses
    assert isinstance(provider.get_model(MODEL), agents.OpenAIResponsesModel)
    stored_before = server.app.state.response_store.usage("alice")[0]
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64)
    agent = agents.Agent(
        name="helper",
        instructions="Use the tools to answer.",
        model=MODEL,
        tools=[get_weather, get_time],
        model_settings=settings,
    )
    result = agents.Runner.run_sync(
        agent,
        "What is the weather in Rome?",
        max_turns=4,
        run_config=agents.RunConfig(model_provider=provider),
    )
    assert called and called[0].split(":")[0] in ("weather", "time")
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) >= 2  # the call turn, then the answer after the tool's
    assert server.app.state.response_store.usage("alice")[0] >= stored_before + 2

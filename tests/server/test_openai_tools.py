"""Tool calling through the official ``openai`` client on the default model (whose template knows
no tools: kvwise describes them in a system message, Hermes-style): ``tool_choice="required"``
and a named function return valid arguments for the declared schema on 20 varied prompts;
streamed calls reassemble to the same call; ``auto`` may answer in text; the tool result turn
renders the call and the result and reuses the call turn's cached blocks; the OpenAI Agents
SDK runs an agent with two function tools end to end; bad tool fields are 400s naming them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.test_openai_client import MODEL, client_for

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert an amount between currencies",
    "parameters": {"type": "object", "properties": {
        "amount": {"type": "number"}, "source": {"type": "string"}, "target": {"type": "string"}},
        "required": ["amount", "source", "target"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, CONVERT]
PROMPTS = [f"What is the weather like in {city}?" for city in (
    "Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Mumbai", "Berlin", "Nairobi")
] + [f"How much is {n} {a} in {b}?" for n, a, b in (
    (10, "USD", "EUR"), (3.5, "GBP", "JPY"), (100, "EUR", "CHF"), (7, "AUD", "NZD"),
    (250, "CAD", "USD"), (1, "BTC", "USD"), (42, "SEK", "NOK"), (9.99, "USD", "INR"),
    (1000, "JPY", "KRW"), (60, "MXN", "BRL"))]  # fmt: skip


@pytest.fixture(scope="module")
def server(real_server):
    return real_server


@pytest.fixture(scope="module")
def alice(server) -> openai.OpenAI:
    return client_for(server, "key-alice")


def _valid(call, tool) -> bool:
    """The call names the tool and its arguments hold the schema's required fields, typed."""
    spec = tool["function"]["parameters"]
    args = json.loads(call.function.arguments)
    if call.function.name != tool["function"]["name"] or set(args) != set(spec["required"]):
        return False
    types = {"string": str, "number": (int, float)}
    for name, prop in spec["properties"].items():
        if not isinstance(args[name], types[prop["type"]]):
            return False
        if "enum" in prop and args[name] not in prop["enum"]:
            return False
    return True


def _ask(client, prompt, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          tools=TOOLS, max_tokens=96, temperature=0, **kwargs)  # fmt: skip


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_are_valid_on_twenty_prompts(alice, choice):
    def one(i_prompt):
        i, prompt = i_prompt
        tool = TOOLS[i // 10] if choice == "required" else TOOLS[i % 2]
        named = {"type": "function", "function": {"name": tool["function"]["name"]}}
        r = _ask(alice, prompt, tool_choice="required" if choice == "required" else named,
                 parallel_tool_calls=False)  # fmt: skip
        return tool, r

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, enumerate(PROMPTS)))
    for (tool, r), prompt in zip(results, PROMPTS, strict=True):
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls", prompt
        calls = choice0.message.tool_calls
        assert len(calls) == 1 and calls[0].id.startswith("call_")
        if choice == "named":
            assert _valid(calls[0], tool), (prompt, calls[0])
        else:
            assert any(_valid(calls[0], t) for t in TOOLS), (prompt, calls[0])


def test_streamed_calls_reassemble_to_the_same_call(alice):
    whole = _ask(alice, PROMPTS[0], tool_choice="required").choices[0].message.tool_calls
    parts: dict[int, dict] = {}
    finish, call_chunks = None, []
    for chunk in _ask(alice, PROMPTS[0], tool_choice="required", stream=True):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or ():
            part = parts.setdefault(d.index, {"name": "", "arguments": ""})
            part["name"] += d.function.name or ""
            part["arguments"] += d.function.arguments or ""
            call_chunks.append(d)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    # incremental, as OpenAI streams: the id and name first, then the arguments in pieces
    for index in parts:
        pieces = [d for d in call_chunks if d.index == index]
        first = pieces[0]
        assert first.id and first.function.name == whole[index].function.name
        assert not first.function.arguments
        assert len(pieces) >= 4 and all(d.id is None for d in pieces[1:])
    assert [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]  # fmt: skip


def test_auto_and_none_answer_in_text(alice):
    r = _ask(alice, "Say hello in French.", tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    r = _ask(alice, "Say hello in French.")  # auto: whatever the model does, well formed
    message = r.choices[0].message
    assert (message.tool_calls is None) == (r.choices[0].finish_reason != "tool_calls")


def test_the_tool_result_turn_reuses_the_call_turns_blocks(server, alice):
    before = server.engine.stats()
    messages = [{"role": "user", "content": PROMPTS[1]}]
    first = alice.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_tokens=96, temperature=0)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21, "sky": "clear"}'}]  # fmt: skip
    second = alice.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           max_tokens=24, temperature=0)  # fmt: skip
    previous = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens > previous
    assert second.usage.prompt_tokens_details.cached_tokens >= previous - 16  # one block
    after = server.engine.stats()  # the call turn paused, the result turn resumed it
    assert after.tool_pauses == before.tool_pauses + 1
    assert after.tool_resumes == before.tool_resumes + 1
    assert after.tool_resumed_device_tokens - before.tool_resumed_device_tokens >= previous - 16
    metrics = httpx.get(server.base_url + "/metrics", headers={"Authorization": "Bearer key-alice"})
    assert "kvwise_tool_pauses_total" in metrics.text
    assert 'kvwise_tool_resumed_tokens_total{source="device"}' in metrics.text


def test_the_agents_sdk_runs_an_agent_with_two_tools(server):
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
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=96)
    agent = agents.Agent(name="helper", instructions="Use the tools to answer.", model=model,
                         tools=[get_weather, get_time], model_settings=settings,
                         tool_use_behavior="stop_on_first_tool")  # fmt: skip
    result = agents.Runner.run_sync(agent, "What is the weather in Rome?", max_turns=3)
    assert called and called[0].split(":")[0] in ("weather", "time")
    assert result.final_output  # the tool's answer, which ended the run


@pytest.mark.parametrize(
    "extra,param",
    [({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
     ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
      "tool_choice"),
     ({"tool_choice": "required"}, "tool_choice"),
     ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice")],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_them(alice, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=4, **extra)  # fmt: skip
    assert info.value.param == param

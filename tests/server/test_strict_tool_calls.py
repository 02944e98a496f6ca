"""A forced tool call always parses (issue 46, item 7), through the official ``openai`` client on
the default model: with the issue's schema as clients send it (no ``additionalProperties``),
``tool_choice="required"`` and a named function return a call whose arguments validate against
the schema with no key it does not name, at any depth, on 20 varied prompts (the issue's "Is it
cold in Perth?" among them: it went ``"unit_map_map_map…`` to max_tokens); json_schema answers
likewise, asked for more fields than their schema has; and a forced call cut by ``max_tokens``
is a truncated call (``finish_reason: length``, the call in ``tool_calls`` with its arguments'
text so far, ``content`` null), streamed or not."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.server.test_openai_client import MODEL, client_for

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}  # fmt: skip
TRIP_ARGS = {"type": "object", "properties": {
    "destination": {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city"]},
    "nights": {"type": "integer"}}, "required": ["destination", "nights"]}  # fmt: skip
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": WEATHER_ARGS}}  # fmt: skip
TRIP = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "description": "Plan a stay somewhere",
        "parameters": TRIP_ARGS,
    },
}
PROMPTS = [
    "Is it cold in Perth?", "What's the weather in Paris?", "Do I need a coat in Oslo today?",
    "How hot is it in Cairo right now?", "Will it rain in Mumbai?", "Tokyo weather please.",
    "Is it sunny in Lima?", "Tell me about the climate of Reykjavik, in fahrenheit.",
    "Should I pack shorts for Sydney?", "Is Toronto snowy at the moment?",
    "I want to spend three nights in Rome.", "Book me a week in Lisbon, Portugal.",
    "Plan two nights in Kyoto.", "How about a weekend in Berlin?", "Nairobi for five nights.",
    "Tell me a joke.", "What is 2 + 2?", "Write a haiku about the sea.",
    "Which is bigger, a whale or an ant?", "hi",
]  # fmt: skip


def closed(schema: dict) -> dict:
    """The schema with every object admitting no other key (written out by hand, not by the
    code under test)."""
    if schema is WEATHER_ARGS:
        return {**WEATHER_ARGS, "additionalProperties": False}
    destination = {**TRIP_ARGS["properties"]["destination"], "additionalProperties": False}
    return {**TRIP_ARGS, "properties": {**TRIP_ARGS["properties"], "destination": destination},
            "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def alice(real_server) -> openai.OpenAI:
    return client_for(real_server, "key-alice")


def _ask(client, prompt: str, tools, **kwargs):
    messages = [{"role": "user", "content": prompt}]
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                          temperature=0, **kwargs)  # fmt: skip


def _check_call(r, tool, prompt: str) -> None:
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (prompt, choice)
    assert choice.message.content is None, prompt
    (call,) = choice.message.tool_calls
    assert call.function.name == tool["function"]["name"], prompt
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, closed(tool["function"]["parameters"]))


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_parse_and_validate_on_twenty_prompts(alice, choice):
    def one(i: int):
        if choice == "required":  # the issue's request: one tool, tool_choice required
            return WEATHER, _ask(alice, PROMPTS[i], [WEATHER], tool_choice="required",
                                 parallel_tool_calls=False)  # fmt: skip
        tool = (WEATHER, TRIP)[i % 2]
        named = {"type": "function", "function": {"name": tool["function"]["name"]}}
        return tool, _ask(alice, PROMPTS[i], [WEATHER, TRIP], tool_choice=named)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, range(len(PROMPTS))))
    for prompt, (tool, r) in zip(PROMPTS, results, strict=True):
        _check_call(r, tool, prompt)


def test_the_issues_request_with_parallel_calls_allowed(alice):
    """The client's defaults (parallel calls allowed): every call the model completes
    validates; one cut by max_tokens is the last, and the answer says ``length``."""
    r = _ask(alice, PROMPTS[0], [WEATHER], tool_choice="required")
    choice = r.choices[0]
    assert choice.message.content is None and choice.message.tool_calls
    whole = choice.message.tool_calls
    if choice.finish_reason == "length":  # the last call may be cut (or only its tag)
        whole = whole[:-1]
    else:
        assert choice.finish_reason == "tool_calls"
    assert whole  # a call takes about 40 of the 64 tokens: the first is complete
    for call in whole:
        jsonschema.validate(json.loads(call.function.arguments), closed(WEATHER_ARGS))


CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                          "country": {"type": "string"}},
        "required": ["city", "country"]}  # fmt: skip
ASKS = [
    "Describe Paris as JSON: city, country, population, mayor and famous sights.",
    "Give me Tokyo's city, country, area, founding year and airports as JSON.",
    "JSON for Cairo with city, country, river, population and climate.",
    "Return a JSON object about Lima: city, country, altitude, language, currency.",
]


def test_json_schema_answers_have_only_the_schemas_keys(alice):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}

    def one(prompt: str):
        return alice.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=fmt,
            max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip

    with ThreadPoolExecutor(len(ASKS)) as pool:
        results = list(pool.map(one, ASKS))
    for prompt, r in zip(ASKS, results, strict=True):
        assert r.choices[0].finish_reason == "stop", (prompt, r.choices[0].message.content)
        answer = json.loads(r.choices[0].message.content)
        jsonschema.validate(answer, {**CITY, "additionalProperties": False})


def test_a_forced_call_cut_by_max_tokens_is_a_truncated_call(alice):
    prompt = PROMPTS[0]
    whole = _ask(alice, prompt, [WEATHER], tool_choice="required").choices[0].message
    arguments = whole.tool_calls[0].function.arguments
    for max_tokens in (3, 20):
        r = _ask(alice, prompt, [WEATHER], tool_choice="required", max_tokens=max_tokens)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and r.usage.completion_tokens == max_tokens
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        cut = call.function.arguments  # the arguments' text so far: a prefix of the whole's
        assert arguments.startswith(cut) and len(cut) < len(arguments), (max_tokens, cut)
        assert (cut == "") == (max_tokens == 3), (max_tokens, cut)
        # streamed: the same call in pieces, no content, the same finish
        stream = _ask(alice, prompt, [WEATHER], tool_choice="required", max_tokens=max_tokens,
                      stream=True)  # fmt: skip
        content, name, streamed, finish = "", "", "", None
        for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or ():
                    assert d.index == 0
                    name += d.function.name or ""
                    streamed += d.function.arguments or ""
                finish = c.finish_reason or finish
        assert (content, name, streamed, finish) == ("", "get_weather", cut, "length")


def test_responses_forced_calls_parse_and_validate_on_twenty_prompts(alice):
    """The same twenty prompts on /v1/responses: tool_choice required (one call), each a
    completed response whose one function_call item validates against the closed schema."""
    weather = {"type": "function", "name": "get_weather", **WEATHER["function"]}

    def one(prompt: str):
        return alice.responses.create(
            model=MODEL,
            input=prompt,
            tools=[weather],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=MAX_TOKENS,
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    for prompt, r in zip(PROMPTS, results, strict=True):
        assert r.status == "completed", (prompt, r.status, r.output)
        (call,) = [item for item in r.output if item.type == "function_call"]
        assert call.name == "get_weather", prompt
        jsonschema.validate(json.loads(call.arguments), closed(WEATHER_ARGS))

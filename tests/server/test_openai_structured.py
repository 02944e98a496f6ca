"""Structured outputs through the official ``openai`` client on the default model:
``chat.completions.parse(response_format=PydanticModel)`` parses on every one of 20 varied
prompts (sent at once: the grammars' masks in one batch), streamed JSON too; json_object
returns an object; the kvwise extension ``structured_outputs`` (regex, choice, Lark grammar)
on chat and completions; an invalid schema or grammar is a 400 naming its field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pydantic
import pytest

from tests.server.test_openai_client import MODEL, client_for

pytestmark = pytest.mark.slow

TOPICS = ["a cat", "the moon", "a bicycle", "Paris", "a violin", "an oak tree", "the ocean",
          "a laptop", "coffee", "a volcano", "a penguin", "chess", "a lighthouse", "bread",
          "a rainbow", "a train", "honey", "a glacier", "a kite", "the piano"]  # fmt: skip


class Thing(pydantic.BaseModel):
    name: str
    colour: str
    size_cm: int
    alive: bool
    tags: list[str]


@pytest.fixture(scope="module")
def alice(real_server) -> openai.OpenAI:
    return client_for(real_server, "key-alice")


def _ask(client: openai.OpenAI, topic: str):
    messages = [{"role": "user", "content": f"Describe {topic} as a JSON object."}]
    return client.chat.completions.parse(model=MODEL, messages=messages, response_format=Thing,
                                         max_tokens=120, temperature=0)  # fmt: skip


def test_parse_with_a_pydantic_model_on_twenty_prompts(alice):
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        results = list(pool.map(lambda t: _ask(alice, t), TOPICS))
    for topic, r in zip(TOPICS, results, strict=True):
        thing = r.choices[0].message.parsed
        assert isinstance(thing, Thing), (topic, r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop", topic
    names = {r.choices[0].message.parsed.name for r in results}
    assert len(names) > 10  # the model's answers, not one shape forced on all


def test_streamed_json_and_json_object(alice):
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Name a city in Japan."}]
    text = "".join(c.choices[0].delta.content or "" for c in alice.chat.completions.create(
        model=MODEL, messages=messages, response_format=fmt, max_tokens=40, temperature=0,
        stream=True) if c.choices)  # fmt: skip
    assert set(json.loads(text)) == {"city"}
    r = alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=60,
                                      response_format={"type": "json_object"}, temperature=0)  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choice_and_grammar_extensions(alice):
    r = alice.completions.create(model=MODEL, prompt="The year the Berlin wall fell:", max_tokens=8,
                                 temperature=0,
                                 extra_body={"structured_outputs": {"regex": r" [0-9]{4}"}})  # fmt: skip
    assert re.fullmatch(r" [0-9]{4}", r.choices[0].text)
    choices = ["positive", "negative", "neutral"]
    r = alice.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Sentiment of: I love this!"}],
        max_tokens=8, temperature=0.9, n=3, extra_body={"structured_outputs": {"choice": choices}})  # fmt: skip
    assert all(c.message.content in choices for c in r.choices)
    lark = 'start: "SELECT " col " FROM " table\ncol: "name" | "age"\ntable: "users" | "orders"'
    r = alice.completions.create(model=MODEL, prompt="SQL:", max_tokens=20, temperature=0,
                                 extra_body={"structured_outputs": {"grammar": lark}})  # fmt: skip
    assert re.fullmatch(r"SELECT (name|age) FROM (users|orders)", r.choices[0].text)


@pytest.mark.parametrize(
    "extra,param",
    [({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "wat"}}}},
      "response_format.json_schema.schema"),
     ({"response_format": {"type": "xml"}}, "response_format"),
     ({"extra_body": {"structured_outputs": {"grammar": "start: ("}}}, "structured_outputs.grammar"),
     ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
     ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice")],
)  # fmt: skip
def test_invalid_constraints_are_400s_naming_the_field(alice, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=4, **extra)  # fmt: skip
    assert info.value.param == param

"""Strict grammars (issue 46, item 7), at the llguidance level over the default model's real
vocabulary: a forced tool call's and a json_schema's grammar admit no key the schema does not
name (the issue's ``"unit_map_map_map…"``), at any depth, and no free whitespace; a schema that
says otherwise explicitly (``additionalProperties``, a function's or a json_schema's
``strict: false``) keeps its other keys; json_object is still any object. And an answer cut by
``max_tokens`` inside a call reads as a truncated call, streamed or whole."""

from __future__ import annotations

import json

import pytest

from kvwise.config import GrammarConfig
from kvwise.engine.grammar_compiler import GrammarCompiler
from kvwise.engine.structured import close_objects, open_objects
from kvwise.server.outputs import FunctionDef
from kvwise.server.tools import ToolCallStream, call_grammar, parse_cut_answer
from kvwise.types import StructuredOutput

# the issue's schema, as the client sent it: no additionalProperties
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}  # fmt: skip
NESTED = {"type": "object", "properties": {
    "where": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "days": {"type": "array", "items": {"$ref": "#/$defs/Day"}}},
    "required": ["where", "days"],
    "$defs": {"Day": {"type": "object", "properties": {"n": {"type": "integer"}}}}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {%s}}\n</tool_call>'
GOOD = '"city": "Perth", "unit": "celsius"'


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok, tok.vocab_size, GrammarConfig(grammar_workers=0))
    yield c
    c.close()


def admits(compiler, tok, spec: StructuredOutput, text: str) -> bool:
    """The grammar admits ``text`` whole, token by token (the model's own tokenization)."""
    grammar = compiler.compile(spec, "t")
    return all(grammar.accept(t) for t in tok.encode(text, add_special_tokens=False))


def tool(parameters, strict=None, name="get_weather") -> StructuredOutput:
    function = FunctionDef(name=name, parameters=parameters, strict=strict)
    return StructuredOutput("grammar", call_grammar([function], None, False), "tools")


def test_a_forced_call_admits_no_key_the_schema_does_not_name(compiler, tok):
    spec = tool(WEATHER)
    assert admits(compiler, tok, spec, CALL % GOOD)
    # the issue's answer: a key the schema never named, after the named ones
    assert not admits(compiler, tok, spec, CALL % (GOOD + ', "unit_map": "celsius"'))
    assert not admits(compiler, tok, spec, CALL % ('"country": "AU", ' + GOOD))
    # explicitly open: by the schema, or by the function's strict: false
    assert admits(compiler, tok, tool({**WEATHER, "additionalProperties": True}),
                  CALL % (GOOD + ', "unit_map": "celsius"'))  # fmt: skip
    assert admits(compiler, tok, tool(WEATHER, strict=False), CALL % (GOOD + ', "x": 1'))


def test_a_function_without_parameters_takes_an_empty_object(compiler, tok):
    for parameters in (None, {"type": "object"}):
        assert admits(compiler, tok, tool(parameters), CALL % "")
        assert not admits(compiler, tok, tool(parameters), CALL % '"x": 1')


def test_whitespace_is_bounded_to_one_spelling(compiler, tok):
    spec = tool(WEATHER)
    for loose in (
        '"city":  "Perth", "unit": "celsius"',
        '"city": "Perth",\n"unit": "celsius"',
        ' "city": "Perth", "unit": "celsius"',
        '"city" : "Perth", "unit": "celsius"',
    ):
        assert not admits(compiler, tok, spec, CALL % loose), loose
    schema = StructuredOutput("json", WEATHER, "rf")
    assert admits(compiler, tok, schema, '{"city":"Perth","unit":"celsius"}')
    assert not admits(compiler, tok, schema, '{"city": "Perth","unit":"celsius"}')
    assert not admits(compiler, tok, schema, '{\n"city":"Perth","unit":"celsius"}')


def test_a_json_schema_is_closed_at_every_depth_unless_it_says_otherwise(compiler, tok):
    spec = StructuredOutput("json", NESTED, "rf")
    good = '{"where":{"city":"Oslo"},"days":[{"n":1}]}'
    assert admits(compiler, tok, spec, good)
    assert not admits(compiler, tok, spec, '{"where":{"city":"Oslo","zip":"0150"},"days":[]}')
    assert not admits(compiler, tok, spec, '{"where":{"city":"Oslo"},"days":[{"n":1,"m":2}]}')
    assert not admits(compiler, tok, spec, '{"where":{"city":"Oslo"},"days":[],"more":1}')
    opened = StructuredOutput("json", open_objects(NESTED), "rf")  # json_schema strict: false
    assert admits(compiler, tok, opened, '{"where":{"city":"Oslo","zip":"0150"},"days":[]}')
    # json_object: any object, as before
    any_object = StructuredOutput("json", {"type": "object"}, "response_format")
    assert admits(compiler, tok, any_object, '{"anything":[1,2],"more":{"x":null}}')


def test_close_objects_leaves_what_it_cannot_close_soundly():
    composed = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert close_objects(composed) == composed  # closing a part would refuse the other's keys
    foreign = {"properties": {"a": {}}, "required": ["a", "b"]}
    assert close_objects(foreign) == foreign  # closed, it would admit nothing
    mapping = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert close_objects(mapping) == mapping
    assert "additionalProperties" not in WEATHER  # a copy: the request's schema is unchanged
    assert close_objects(WEATHER)["additionalProperties"] is False
    assert open_objects(WEATHER)["additionalProperties"] is True


NAMES = {"get_weather"}
CUTS = {  # an answer cut by max_tokens -> (name, arguments' text so far)
    "inside the arguments": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pe',
                             '{"city": "Pe'),
    "inside the name": ('<tool_call>\n{"name": "get_wea', ""),
    "inside the tag": ("<tool_", ""),
    "after the arguments": (CALL.split("\n</")[0] % GOOD, "{" + GOOD + "}"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CUTS))
def test_an_answer_cut_inside_a_call_is_a_truncated_call(case):
    text, arguments = CUTS[case]
    content, calls = parse_cut_answer(text, NAMES)
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", arguments)]
    # streamed in pieces: the same call, no content
    parser = ToolCallStream(NAMES)
    sent, deltas = [], []
    for i in range(0, len(text), 3):
        piece, more = parser.feed(text[i : i + 3])
        sent.append(piece)
        deltas += more
    piece, more = parser.finish(cut=True)
    sent.append(piece)
    deltas += more
    assert "".join(sent) == ""
    assert "".join(d.function.arguments or "" for d in deltas) == arguments
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]


def test_a_cut_answer_without_a_call_is_text_and_a_begun_call_of_no_one_name_is_dropped():
    assert parse_cut_answer("It is sunny in Pe", NAMES) == ("It is sunny in Pe", [])
    two = {"get_weather", "get_time"}
    content, calls = parse_cut_answer('Sure.\n<tool_call>\n{"name": "get_', two)
    assert (content, calls) == ("Sure.", [])
    content, calls = parse_cut_answer('<tool_call>\n{"name": "get_t', two)
    assert content is None and [c.function.name for c in calls] == ["get_time"]
    # the whole answer, not cut, parses as before
    whole = CALL % GOOD
    assert json.loads(parse_cut_answer(whole, NAMES)[1][0].function.arguments)["city"] == "Perth"
    # a bare JSON answer that is no call's head stays the answer's text
    assert parse_cut_answer('{"answer": 4, "why": "be', NAMES) == ('{"answer": 4, "why": "be', [])

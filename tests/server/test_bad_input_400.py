"""Issue 45 items 5-6: inputs that once answered 500 (or 200 with nothing) are each a 400
naming the field, through the real HTTP app on the tiny model, and the next request on the
same keep-alive connection still works.

Then a bounded fuzzer (Hypothesis: the three bodies that once answered 500, then 60 random
cases of a few tokens each, ~5 s on two cores) over the fields that schemathesis' generic
strategy (test_fuzz.py) rarely reaches in a meaningful shape: tools (mostly well-formed, their
parameter schemas fuzzed), tool_choice, logit_bias, response_format. No response may be >= 500.
"""

from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .conftest import KEYS

HEADERS = {"Authorization": f"Bearer {next(iter(KEYS))}", "Content-Type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
OBJ = {"type": "object", "properties": {"x": {"type": "integer"}}}


def _tool(name="f", parameters=None):
    return {"type": "function", "function": {"name": name, "parameters": parameters or OBJ}}


def _post(conn: http.client.HTTPConnection, body: dict | str) -> tuple[int, dict]:
    raw = body if isinstance(body, str) else json.dumps(body)
    conn.request("POST", "/v1/chat/completions", raw.encode("utf-8", "surrogatepass"), HEADERS)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


# (body overrides, the field the 400 must name: the error's param starts with it)
CASES = {
    "tool_choice function as a string": (
        {"tools": [_tool()], "tool_choice": {"type": "function", "function": "f"}},
        "tool_choice",
    ),
    "tool_choice without function": (
        {"tools": [_tool()], "tool_choice": {"type": "function"}},
        "tool_choice",
    ),
    "surrogate in a tool parameter's property name": (
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type": '
        '"function", "function": {"name": "f", "parameters": {"type": "object", "properties": '
        '{"\\ud800": {"type": "string"}}}}}]}',
        "tools[0].function.parameters.properties",
    ),
    "surrogate in a response_format schema key": (
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": '
        '{"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", '
        '"properties": {"a\\udfff": {"type": "string"}}}}}}',
        "response_format.json_schema.schema.properties",
    ),
    "surrogate in a logit_bias key": (
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
        '"logit_bias": {"\\ud800": 1}}',
        "logit_bias",
    ),
    "superscript digit logit_bias key": ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    "Arabic-Indic digit logit_bias key": ({"logit_bias": {"\u0663": 1}}, "logit_bias"),
    "a 5,000-digit logit_bias key": ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    "out-of-vocabulary logit_bias key": ({"logit_bias": {"100000000": 1}}, "logit_bias"),
    "negative logit_bias key": ({"logit_bias": {"-1": 1}}, "logit_bias"),
    "duplicate tool names": ({"tools": [_tool(), _tool()]}, "tools"),
    "a string tool parameters schema": (
        {"tools": [_tool("f", OBJ), _tool("g", {"type": "string"})], "tool_choice": "required"},
        "tools[1].function.parameters",
    ),
    "a self-referencing tool parameters schema": (
        {"tools": [_tool("f", {"$ref": "#"})], "tool_choice": "required"},
        "tools[0].function.parameters",
    ),
    "a tool parameters schema that does not compile": (
        {
            "tools": [_tool("f", {"type": "object", "properties": {"x": {"$ref": "#/$defs/no"}}})],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    "a self-referencing response_format schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"$ref": "#"}},
            }
        },
        "response_format",
    ),
    "mutually recursive $refs": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "s",
                    "schema": {
                        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                        "$ref": "#/$defs/a",
                    },
                },
            }
        },
        "response_format",
    ),
}


@pytest.fixture
def conn(tiny_server):
    host, port = tiny_server.base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    yield connection
    connection.close()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_400_naming_the_field(conn, case):
    body, field = CASES[case]
    if isinstance(body, dict):
        body = {"messages": USER, "max_tokens": 2, **body}
    status, answer = _post(conn, body)
    assert status == 400, (case, status, answer)
    param = answer["error"]["param"]
    assert param == field or param.startswith(field + ".") or param.startswith(field + "["), (
        case,
        answer["error"],
    )
    # the same keep-alive connection serves the next request
    status, answer = _post(conn, {"messages": USER, "max_tokens": 2})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["role"] == "assistant"


def test_a_satisfiable_recursive_schema_still_works(conn):
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": tree}}
    status, answer = _post(conn, {"messages": USER, "max_tokens": 2, "response_format": fmt})
    assert status == 200, answer


def test_a_tool_schema_with_defs_and_refs_is_called(conn):
    """pydantic writes nested models as "#/$defs/..." refs: they resolve within the tool's own
    schema (once they were looked up in the call grammar's wrapper: a 400)."""
    params = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "required": ["p"],
        "$defs": {
            "P": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        },
    }
    body = {
        "messages": USER,
        "max_tokens": 48,
        "temperature": 0,
        "tools": [_tool("f", params)],
        "tool_choice": "required",
        "parallel_tool_calls": False,  # one call (a second one cut by max_tokens: length)
    }
    status, answer = _post(conn, body)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "tool_calls", answer
    arguments = json.loads(
        answer["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    )
    assert isinstance(arguments["p"]["n"], int)


# ---- fuzzing the tool / logit_bias / response_format fields ---------------------------------

_names = st.sampled_from(["f", "g", "x.y", "\ud800", "", "²"])
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**20) | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(_names | st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
_schemas = st.one_of(
    st.just(OBJ),
    st.just({"$ref": "#"}),
    st.just({"type": "string"}),
    st.just({}),
    st.just({"type": "object", "properties": {"\ud800": {}}}),
    st.dictionaries(
        st.sampled_from(
            ["type", "properties", "required", "$ref", "enum", "items", "anyOf", "$defs", "pattern"]
        ),
        _json,
        max_size=3,
    ),
    _json,
)
# mostly well-formed tools (so the checks past pydantic's are reached), their schemas fuzzed
_tools = st.one_of(
    st.lists(
        st.builds(
            lambda name, parameters: {
                "type": "function",
                "function": {"name": name, "parameters": parameters},
            },
            st.sampled_from(["f", "g"]),
            _schemas,
        ),
        min_size=1,
        max_size=2,
    ),
    st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["function", "x"]),
                "function": st.one_of(
                    st.fixed_dictionaries({"name": _names, "parameters": _schemas}), _json
                ),
            }
        ),
        max_size=2,
    ),
    _json,
)
_tool_choice = st.one_of(
    st.sampled_from(["none", "auto", "required", "other"]),
    st.just({"type": "function", "function": "f"}),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "x"]),
            "function": st.one_of(st.fixed_dictionaries({"name": _names}), _json),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": st.sampled_from("fgh")}),
        }
    ),
    _json,
)
_logit_bias = (
    st.dictionaries(
        st.sampled_from(["0", "5", "²", "٣", "-1", "1e3", "9" * 5000, "\ud800", " 1", "1_0"])
        | st.text(max_size=3),
        st.integers(-150, 150) | _json,
        max_size=3,
    )
    | _json
)
_response_format = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.one_of(
                st.fixed_dictionaries({"name": st.just("s"), "schema": _schemas}), _json
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "y"])}),
    _json,
)
_bodies = st.fixed_dictionaries(
    {"messages": st.just(USER), "max_tokens": st.just(2)},
    optional={
        "tools": _tools,
        "tool_choice": _tool_choice,
        "logit_bias": _logit_bias,
        "response_format": _response_format,
        "parallel_tool_calls": _json,
    },
)


def test_fuzzed_tool_and_format_fields_never_cause_a_server_error(conn, tiny_server):
    @settings(
        max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(body=_bodies)
    @example(
        body={
            "messages": USER,
            "max_tokens": 2,
            "tools": [_tool()],
            "tool_choice": {"type": "function", "function": "f"},
        }
    )  # once a 500
    @example(body={"messages": USER, "max_tokens": 2, "logit_bias": {"\u00b2": 1}})  # once a 500
    @example(
        body={
            "messages": USER,
            "max_tokens": 2,
            "tools": [_tool("f", {"type": "object", "properties": {"\ud800": {}}})],
        }
    )  # once a 500
    def fuzz(body):
        raw = json.dumps(body, ensure_ascii=True)  # surrogates as \ud800 escapes
        status, answer = _post(conn, raw)
        assert status < 500, (body, answer)

    fuzz()
    tiny_server.engine.call_sync(lambda e: e.check_integrity())

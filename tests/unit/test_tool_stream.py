"""A streamed answer's tool calls (``server.tools.ToolCallStream``): whatever the pieces the
text arrives in, the content and calls a client reassembles are what ``parse_tool_calls``
reads of the whole answer, and a call's first delta goes out before its arguments end."""

from __future__ import annotations

import json
import random

import pytest

from kvwise.server.tools import ToolCallStream, parse_tool_calls

NAMES = {"get_weather", "convert"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CONVERT = '{"name": "convert", "arguments": {"amount": 3.5, "source": "a}b{\\"c", "target": "[x"}}'
ANSWERS = {
    "one call": f"<tool_call>\n{WEATHER}\n</tool_call>",
    "content, then a call": f"Let me check that.\n<tool_call>\n{WEATHER}\n</tool_call>",
    "parallel calls": f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{CONVERT}\n</tool_call>",
    "llama 3 bare json": '{"name": "convert", "parameters": {"amount": 1, "source": "EUR", '
    '"target": "USD"}}',
    "text": "Bonjour ! 1 < 2, and <b>bold</b>, not a <tool call.",
    "a prefix of the tag at the end": "It is sunny <tool_ca",
    "an unknown function": '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
    "another field order": '<tool_call>\n{"arguments": {"city": "Oslo", "unit": "celsius"}, '
    '"name": "get_weather"}\n</tool_call>',
    "text after the call": f"<tool_call>\n{WEATHER}\n</tool_call>\nDone.",
}


def _stream(text: str, pieces: list[int]):
    """Feed ``text`` in pieces of these sizes; (content, calls as (name, args), the character
    count at which the first call delta went out)."""
    parser = ToolCallStream(NAMES)
    content, calls, first_at, at = [], {}, None, 0
    for size in pieces:
        piece, at = text[at : at + size], at + size
        out, deltas = parser.feed(piece)
        content.append(out)
        if deltas and first_at is None:
            first_at = at
        for d in deltas:
            call = calls.setdefault(d.index, ["", ""])
            call[0] += d.function.name or ""
            call[1] += d.function.arguments or ""
    out, deltas = parser.finish()
    content.append(out)
    for d in deltas:
        call = calls.setdefault(d.index, ["", ""])
        call[0] += d.function.name or ""
        call[1] += d.function.arguments or ""
    assert [c.function.name for c in parser.calls] == [calls[i][0] for i in sorted(calls)]
    return "".join(content), [(n, json.loads(a)) for n, a in calls.values()], first_at


def _pieces(text: str, rng: random.Random) -> list[int]:
    sizes, left = [], len(text)
    while left > 0:
        sizes.append(min(left, rng.randint(1, 6)))
        left -= sizes[-1]
    return sizes


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_the_stream_reassembles_to_the_whole_answers_parse(case):
    text = ANSWERS[case]
    content, calls = parse_tool_calls(text, NAMES)
    want = ((content or "") if calls else text,
            [(c.function.name, json.loads(c.function.arguments)) for c in calls])  # fmt: skip
    rng = random.Random(case)
    for pieces in ([1] * len(text), [len(text)], _pieces(text, rng), _pieces(text, rng)):
        got_content, got_calls, _ = _stream(text, pieces)
        assert (got_content, got_calls) == want, (case, pieces)


def test_a_call_goes_out_when_its_name_is_complete():
    text = ANSWERS["content, then a call"]
    _, _, first_at = _stream(text, [1] * len(text))
    name_end = text.index('"get_weather"') + len('"get_weather", "arguments": {')
    assert first_at == name_end  # its name known and its arguments begun: not at the end
    parser = ToolCallStream(NAMES)
    out, _ = parser.feed("Let me check that.\n<tool")
    assert out == "Let me check that."  # the tag's beginning and the newline held back


def test_a_malformed_call_in_auto_streams_as_far_as_it_goes():
    parser = ToolCallStream(NAMES)
    _, deltas = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert deltas[0].function.name == "get_weather"
    assert parser.finish() == ("", []) and len(parser.calls) == 1

"""The Responses API's pure parts: the store of responses (per tenant, bounded in count, bytes
and time, another tenant's id a miss like none) and the translation of a conversation's items
into the chat messages the engine renders."""

from __future__ import annotations

import pytest

from kvwise.errors import InvalidRequest
from kvwise.server.conversations import ResponseStore, StoreLimits
from kvwise.server.responses_protocol import ResponsesRequest, chat_prompt


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _response(i: int, text: str = "") -> dict:
    return {"id": f"resp_{i}", "object": "response", "text": text}


def _user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def test_a_tenants_responses_are_its_own():
    store = ResponseStore()
    store.put("alice", _response(1), [_user("hi")])
    assert store.get("alice", "resp_1").items == [_user("hi")]
    assert store.get("bob", "resp_1") is None  # the same miss as an id never stored
    assert store.get("bob", "resp_2") is None
    assert not store.delete("bob", "resp_1") and store.get("alice", "resp_1") is not None
    assert store.delete("alice", "resp_1") and store.get("alice", "resp_1") is None
    assert store.usage("alice") == (0, 0)


def test_responses_expire_after_the_ttl_unless_continued():
    clock = Clock()
    store = ResponseStore(StoreLimits(ttl_s=60), clock=clock)
    store.put("alice", _response(1), [_user("a")])
    store.put("alice", _response(2), [_user("b")])
    clock.now += 50
    assert store.get("alice", "resp_1", touch=True) is not None  # continued: 60 s from now
    clock.now += 20
    assert store.get("alice", "resp_2") is None  # 70 s after it was stored
    assert store.get("alice", "resp_1") is not None
    clock.now += 41
    assert store.get("alice", "resp_1") is None
    assert store.usage("alice") == (0, 0)


def test_bounds_are_per_tenant_and_evict_the_least_recently_used():
    store = ResponseStore(StoreLimits(max_responses=3))
    for i in range(3):
        store.put("bob", _response(100 + i), [_user("b")])
    for i in range(5):
        store.put("alice", _response(i), [_user("a")])
        if i == 2:
            store.get("alice", "resp_0", touch=True)  # used: kept over resp_1 and resp_2
    assert [i for i in range(5) if store.get("alice", f"resp_{i}")] == [0, 3, 4]
    assert store.usage("bob")[0] == 3  # alice's traffic evicts none of bob's


def test_bytes_bound_counts_whole_conversations():
    store = ResponseStore(StoreLimits(max_bytes=4000))
    first = [_user("x" * 1000)]
    assert store.put("alice", _response(1), first)
    previous = store.get("alice", "resp_1")
    second = [*first, {"type": "message", "role": "assistant", "content": "y" * 1000}]
    assert store.put("alice", _response(2), second, previous)
    _, num_bytes = store.usage("alice")
    assert 3000 < num_bytes < 3400  # 1,000 + 2,000 characters of conversation, and the heads
    third = [*second, _user("z" * 1000)]
    assert store.put("alice", _response(3), third, store.get("alice", "resp_2"))
    assert store.get("alice", "resp_1") is None and store.get("alice", "resp_2") is None
    assert store.get("alice", "resp_3").items == third
    assert not store.put("alice", _response(4), [_user("w" * 5000)])  # alone over the bound
    assert store.get("alice", "resp_4") is None


@pytest.mark.parametrize("field,value", [("ttl_s", 0), ("max_bytes", 0), ("max_responses", 0)])
def test_limits_name_their_flag(field, value):
    with pytest.raises(ValueError, match="responses_store"):
        StoreLimits(**{field: value})


def test_items_render_as_chat_messages():
    body = ResponsesRequest(
        input=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather "},
                    {"type": "input_text", "text": "in Rome?"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "w",
                "arguments": '{"city": "Rome"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "noon"}],
            },
        ]
    )
    messages = chat_prompt(body.input_items(), "Sys.", None)
    assert [m["role"] for m in messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
    ]
    assert messages[2]["content"] == "Weather in Rome?"
    assistant = messages[3]
    assert assistant["content"] == "Let me look."
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["w", "t"]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert messages[4] == {"role": "tool", "tool_call_id": "c1", "name": "w", "content": "sunny"}
    assert messages[5]["content"] == "noon"


def test_an_output_without_its_call_names_input():
    body = ResponsesRequest(input=[{"type": "function_call_output", "call_id": "x", "output": "1"}])
    with pytest.raises(InvalidRequest) as info:
        chat_prompt(body.input_items(), None, None)
    assert info.value.param == "input"


def test_serve_flags_set_the_store_and_refuse_bad_values(capsys):
    from kvwise.cli import build_parser, main

    args = build_parser().parse_args(["serve"])
    assert (args.responses_store_ttl, args.responses_store_memory) == (3600.0, "64MiB")
    assert args.responses_store_max == 10_000
    for flag, bad in (("--responses-store-ttl", "0"), ("--responses-store-max", "0")):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", flag, bad])
        assert info.value.code == 2
    assert main(["serve", "--port", "18461", "--responses-store-memory", "lots"]) == 2
    assert "--responses-store-memory" in capsys.readouterr().err

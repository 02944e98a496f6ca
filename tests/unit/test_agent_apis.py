"""``kvwise bench agents --apis``: the same two-turn conversation in each API is a request
the server's own models accept, naming the same tool call; each dialect's stream reads back
into the same answer."""

import asyncio
import json

import pytest

from kvwise.bench import agent_apis
from kvwise.bench.agents import TOOL
from kvwise.server.anthropic_protocol import MessagesRequest
from kvwise.server.protocol import ChatCompletionRequest
from kvwise.server.responses_protocol import ResponsesRequest

HISTORY = [
    {"role": "system", "content": "You are a research agent."},
    {"role": "user", "content": "Find the docs."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "kv"}'},
            }
        ],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "call_1", "content": "KV caches hold keys and values."},
]
MODELS = {"chat": ChatCompletionRequest, "messages": MessagesRequest, "responses": ResponsesRequest}


@pytest.mark.parametrize("api", agent_apis.APIS)
def test_each_api_body_is_a_valid_request_with_one_forced_call(api):
    body = agent_apis.request_body(api, "m", HISTORY, TOOL, 48)
    request = MODELS[api].model_validate(body)
    assert request.stream is True
    text = json.dumps(body)
    assert "call_1" in text and "KV caches hold" in text and "research agent" in text


def test_an_unknown_api_names_the_field():
    with pytest.raises(ValueError, match="api"):
        agent_apis.request_body("soap", "m", HISTORY, TOOL, 48)


class FakeStream:
    def __init__(self, events):
        self.status_code = 200
        self.lines = [f"data: {json.dumps(e)}" for e in events]

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def aiter_lines(self):
        for line in self.lines:
            yield line


class FakeHttp:
    def __init__(self, events):
        self.events = events

    def stream(self, method, url, json, headers):
        return FakeStream(self.events)


MESSAGES_EVENTS = [
    {"type": "message_start", "message": {"usage": {
        "input_tokens": 4, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 0}}},
    {"type": "content_block_start", "index": 0,
     "content_block": {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}},
    {"type": "content_block_delta", "index": 0,
     "delta": {"type": "input_json_delta", "partial_json": '{"query": '}},
    {"type": "content_block_delta", "index": 0,
     "delta": {"type": "input_json_delta", "partial_json": '"kv"}'}},
    {"type": "message_stop"},
]  # fmt: skip
RESPONSES_EVENTS = [
    {"type": "response.output_item.added",
     "item": {"type": "function_call", "call_id": "call_9", "name": "search", "arguments": ""}},
    {"type": "response.function_call_arguments.delta", "delta": '{"query": '},
    {"type": "response.function_call_arguments.delta", "delta": '"kv"}'},
    {"type": "response.completed", "response": {"usage": {
        "input_tokens": 36, "input_tokens_details": {"cached_tokens": 32}}}},
]  # fmt: skip


@pytest.mark.parametrize(("api", "events"), [("messages", MESSAGES_EVENTS),
                                             ("responses", RESPONSES_EVENTS)])  # fmt: skip
def test_each_stream_reads_back_into_one_call_and_chat_usage(api, events):
    answer = asyncio.run(agent_apis.streamed_answer(FakeHttp(events), "u", api, {}, {}))
    (call,) = answer["calls"]
    assert call["function"] == {"name": "search", "arguments": '{"query": "kv"}'}
    assert answer["usage"] == {"prompt_tokens": 36, "prompt_tokens_details": {"cached_tokens": 32}}

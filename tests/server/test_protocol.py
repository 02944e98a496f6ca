"""The HTTP layer on the tiny model, with raw httpx: response shapes, SSE framing, every kind of
bad input as a 4xx OpenAI error naming the field, auth, health, models and metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.hits import whole_hit

from .conftest import TINY_CONTEXT, TINY_NAME

ALICE = {"Authorization": "Bearer key-alice"}
CHAT = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, headers=ALICE, timeout=30) as client:
        yield client


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE body; every event must be ``data: ...`` + blank line."""
    text = response.text
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]


def test_completion_shape(client):
    r = client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 5, "seed": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == TINY_NAME
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_default_max_tokens_is_16_and_token_prompt(client):
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_chat_non_streaming_and_streaming_agree(client, tiny_server):
    body = {**CHAT, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["choices"][0]["finish_reason"] == "length"
    r = client.post(
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    # the whole prompt was just computed: its full blocks come from the cache (the last
    # token is computed again to sample from; a block-aligned prompt's reads its own K/V)
    block_size = tiny_server.engine.engine.kv_manager.block_size
    num_prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert num_prompt_tokens > block_size  # so that there is a block to hit
    cached = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == whole_hit(num_prompt_tokens, block_size)


def test_completion_streaming_without_usage(client):
    r = client.post(
        "/v1/completions",
        json={"prompt": "abc", "max_tokens": 3, "stream": True, "ignore_eos": True},
    )
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_and_seeded_sampling(client):
    body = {"prompt": "The", "max_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    a = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert a == b
    if len(a) > 2:
        stop = a[1:3]
        r = client.post("/v1/completions", json={**body, "stop": stop}).json()
        assert r["choices"][0]["finish_reason"] == "stop" and stop not in r["choices"][0]["text"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "bot", "content": "x"}]},
            "messages[0].role",
        ),
        ("/v1/chat/completions", {**CHAT, "temperature": 3}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {**CHAT, "n": 17}, "n"),
        ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"1": 101}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": ["x"] * 65}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "cache_salt": ""}, "cache_salt"),
        (
            "/v1/chat/completions",
            {**CHAT, "prompt_cache_retention": "1y"},
            "prompt_cache_retention",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x " * 400}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": ["a", [10**9]]}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": list(range(TINY_CONTEXT))}, "prompt"),
        (
            "/v1/completions",
            {"prompt": "x", "echo": True, "max_tokens": 0, "stream": True},
            "max_tokens",
        ),  # fmt: skip
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {}, "prompt"),
    ],
)
def test_bad_input_is_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"].startswith(param), error


def test_context_overflow_code(client):
    r = client.post("/v1/completions", json={"prompt": list(range(TINY_CONTEXT + 5))})
    assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "content, content_type",
    [(b"{not json", "application/json"), (b"[1, 2]", "application/json"), (b"", None)],
)
def test_invalid_json_is_400(client, content, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    r = client.post("/v1/chat/completions", content=content, headers=headers)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_is_404(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/models/gpt-9").status_code == 404
    assert client.get("/v1/models/tiny").json()["id"] == TINY_NAME


def test_unknown_route_is_openai_error(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-alice"}]
)
def test_missing_or_invalid_key_is_401(tiny_server, headers):
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        r = httpx.request(method, tiny_server.base_url + path, json=CHAT, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    # invalid JSON without a key is still 401: auth comes before the body
    r = httpx.post(tiny_server.base_url + "/v1/completions", content=b"{", headers=headers)
    assert r.status_code == 401


def test_models_health_metrics(client, tiny_server):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [TINY_NAME]
    assert httpx.get(tiny_server.base_url + "/health").json() == {"status": "ok"}
    client.post("/v1/completions", json={"prompt": "metrics please", "max_tokens": 2})
    text = httpx.get(tiny_server.base_url + "/metrics").text
    for name in (
        'kvwise_http_requests_total{route="/v1/completions",status="200"}',
        'kvwise_http_requests_total{route="/v1/chat/completions",status="400"}',
        "kvwise_prompt_tokens_total",
        "kvwise_cached_prompt_tokens_total",
        "kvwise_generation_tokens_total",
        "kvwise_time_to_first_token_seconds_bucket",
        "kvwise_inter_token_latency_seconds_bucket",
        "kvwise_requests_waiting",
        "kvwise_requests_running",
        "kvwise_kv_blocks_used",
        "kvwise_kv_blocks_cached",
        "kvwise_kv_blocks_free",
        "kvwise_prefix_cache_queries_tokens_total",
        "kvwise_prefix_cache_hits_tokens_total",
    ):
        assert name in text, name


def test_one_log_line_per_finished_request(client, caplog):
    with caplog.at_level("INFO", logger="kvwise.server"):
        client.post("/v1/completions", json={"prompt": "log me", "max_tokens": 2})
    lines = [r.getMessage() for r in caplog.records if r.name == "kvwise.server"]
    assert len(lines) == 1
    for part in ("tenant=alice", "prompt=", "cached=", "completion=2", "ttft=", "tokens/s="):
        assert part in lines[0]
    assert "finish=length" in lines[0] or "finish=stop" in lines[0]


def test_prompt_cache_retention_24h_keeps_the_prefix(client, tiny_server):
    prompt = "retention " * 40
    assert tiny_server.engine.stats().kv.blocks_kept == 0
    body = {"prompt": prompt, "max_tokens": 2, "prompt_cache_retention": "in_memory"}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert tiny_server.engine.stats().kv.blocks_kept == 0
    body = {**body, "prompt_cache_retention": "24h", "prompt_cache_key": "ignored"}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert tiny_server.engine.call_sync(lambda e: e.stats().kv.blocks_kept) > 0


@pytest.mark.parametrize("extra", [{"temperature": 1e-40}, {"seed": 2**62}, {"seed": -(2**63)}])
def test_extreme_sampling_values_do_not_break_a_step(client, extra):
    """The sampler overflows on these (NaN probabilities, a seed past 64 bits): the server maps
    a tiny temperature to greedy and folds the seed to 32 bits."""
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    assert client.get("/health").status_code == 200

"""Backpressure and disconnects on a slowed tiny model (20 ms a step): a full waiting queue is
a 429 with Retry-After; a client that goes away mid-request has its blocks freed at once."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvwise.engine.async_engine import AsyncEngine
from kvwise.server import create_app
from tests.fakes import ControlledRunner

from .conftest import TINY_NAME, LiveServer, wait_for

LONG = {"prompt": "tell me a story " * 8, "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def slow_server(make_tiny_engine):
    engine = make_tiny_engine(max_num_seqs=1, max_waiting=1, wrap_runner=ControlledRunner)
    engine.runner.delay_s = 0.02  # every step: to catch a request mid-stream
    async_engine = AsyncEngine(engine, retry_after_s=2)
    with LiveServer(create_app(async_engine, model_name=TINY_NAME)) as server:
        yield server
    async_engine.shutdown()


def used_blocks(server) -> int:
    return server.engine.call_sync(lambda e: e.kv_manager.pool.num_used_blocks)


def assert_all_freed(server) -> None:
    assert wait_for(lambda: used_blocks(server) == 0, timeout=2.0), "blocks not freed"
    stats = server.engine.call_sync(lambda e: e.stats())
    assert stats.num_running == 0 and stats.num_waiting == 0
    server.engine.call_sync(lambda e: e.check_integrity())


def test_disconnect_mid_stream_frees_blocks(slow_server):
    with httpx.Client(base_url=slow_server.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            # NOTE: mid-stream is judged by the pool, not by counting events: a random tiny
            # model may emit many tokens whose text is empty, so events can lag the tokens.
            assert wait_for(lambda: used_blocks(slow_server) > 0, timeout=2.0)
            next(r.iter_lines())
    # 200 tokens take 4 s; the blocks must be back long before that
    assert_all_freed(slow_server)
    metrics = httpx.get(slow_server.base_url + "/metrics").text
    assert 'kvwise_requests_finished_total{finish_reason="abort"}' in metrics


def test_disconnect_while_waiting_for_a_non_streamed_answer_frees_blocks(slow_server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.base_url + "/v1/completions", json=LONG, timeout=0.5)
    assert_all_freed(slow_server)


def test_full_queue_is_429_with_retry_after(slow_server):
    body = {**LONG, "stream": True}
    engine = slow_server.engine
    with httpx.Client(base_url=slow_server.base_url, timeout=30) as c1:
        with c1.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            assert wait_for(lambda: engine.stats().num_running == 1)
            with httpx.Client(base_url=slow_server.base_url, timeout=30) as c2:
                with c2.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "queued"}], **body},
                ) as waiting:
                    assert waiting.status_code == 200
                    assert wait_for(lambda: engine.stats().num_waiting == 1)
                    r = httpx.post(slow_server.base_url + "/v1/completions", json=LONG)
                    assert r.status_code == 429
                    assert r.headers["Retry-After"] == "2"
                    assert r.json()["error"]["type"] == "rate_limit_error"
                    client = openai.OpenAI(
                        base_url=slow_server.base_url + "/v1", api_key="-", max_retries=0
                    )
                    with pytest.raises(openai.RateLimitError):
                        client.completions.create(model=TINY_NAME, prompt="x", max_tokens=2)
    assert_all_freed(slow_server)
    r = httpx.post(slow_server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_engine_down_is_503_and_unhealthy(slow_server):
    """Last in this module: it stops the engine."""
    slow_server.engine.shutdown()
    r = httpx.post(slow_server.base_url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"
    health = httpx.get(slow_server.base_url + "/health")
    assert health.status_code == 503 and "shut down" in health.json()["status"]
    assert "kvwise_engine_up 0.0" in httpx.get(slow_server.base_url + "/metrics").text

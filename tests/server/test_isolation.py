"""One caller's request never holds up another's stream: what a request brings (its chat
template, its tokens) is handled off the engine thread, with its cost bounded before any work,
and what it may make the engine remember is bounded too.

A live server over the tiny random model with the default model's tokenizer and chat template
(its context: 256 tokens), each step slowed to 20 ms so that a stream runs for seconds.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvwise.engine.async_engine import AsyncEngine
from kvwise.engine.chat_template import MAX_MESSAGES
from kvwise.errors import ContextLengthExceeded, InvalidRequest
from kvwise.server import create_app
from kvwise.server.transport import InvalidRequestBudget
from kvwise.types import MAX_KEY_CHARS, RequestOptions, SamplingParams
from tests.fakes import ControlledRunner

from .conftest import KEYS, TINY_NAME, LiveServer

ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def slow_server(make_tiny_engine):
    engine = make_tiny_engine(wrap_runner=lambda r: ControlledRunner(r, delay_s=0.02))
    app = create_app(engine, api_keys=KEYS, model_name=TINY_NAME)
    with LiveServer(app) as server:
        yield server


class _Stream(threading.Thread):
    """Alice's stream in the background: the arrival time of every SSE event."""

    def __init__(self, base: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
        self.times: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": TINY_NAME,
            "prompt": "A stream that runs while another tenant floods the server",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.Client(base_url=self.base, timeout=60, headers=ALICE) as client:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            self.times.append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def max_gap_after(self, start: float) -> float:
        times = [t for t in self.times if t >= start]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def test_a_message_flood_gets_its_400_while_another_stream_keeps_going(slow_server):
    stream = _Stream(slow_server.base_url, max_tokens=150)  # ~3 s of 20 ms steps
    stream.start()
    deadline = time.perf_counter() + 10
    while len(stream.times) < 5 and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert len(stream.times) >= 5, stream.error
    flood_start = time.perf_counter()
    with httpx.Client(base_url=slow_server.base_url, timeout=60, headers=BOB) as client:
        # ~230,000 tiny messages (7 MiB, under the 8 MiB body limit)
        flood = {"model": TINY_NAME, "messages": [{"role": "user", "content": ""}] * 230_000}
        body = json.dumps(flood).encode()
        assert len(body) < 8 * 2**20
        t0 = time.perf_counter()
        r = client.post(
            "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
        )
        flood_s = time.perf_counter() - t0
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
        # as many messages as allowed, each short, but rendered longer than the context holds
        r = client.post(
            "/v1/chat/completions",
            json={"model": TINY_NAME, "messages": [{"role": "user", "content": ""}] * 2048},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
        assert "rendered" in r.json()["error"]["message"]
        # text and token ids over the context: refused before they are tokenized or checked
        for prompt in ("x" * 5_000_000, [1] * 1_000_000):
            r = client.post(
                "/v1/completions", json={"model": TINY_NAME, "prompt": prompt, "max_tokens": 1}
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "prompt"
    flood_end = time.perf_counter()
    stream.join(30)
    assert stream.error is None, stream.error
    assert flood_s < 3.0, f"the flood's 400 took {flood_s:.1f} s"
    assert stream.times[-1] > flood_end, "the stream ended before the flood was over"
    gap = stream.max_gap_after(flood_start)
    assert gap < 1.0, f"alice's stream stopped for {gap:.2f} s during bob's flood"


@pytest.mark.parametrize(
    "field, extra",
    [
        ("prompt_cache_key", {"prompt_cache_key": "k" * (MAX_KEY_CHARS + 1)}),
        ("cache_salt", {"cache_salt": "s" * (MAX_KEY_CHARS + 1)}),
        ("stop", {"stop": ["x"] * 65}),
        ("stop", {"stop": ["x" * 1025]}),
        ("stop_token_ids", {"stop_token_ids": [1] * 1025}),
    ],
)
def test_per_request_state_is_bounded(slow_server, field, extra):
    body = {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 1, **extra}
    with httpx.Client(base_url=slow_server.base_url, timeout=30, headers=ALICE) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        r = client.post("/v1/kvwise/park", json={"prompt_cache_key": "k" * 4_000_000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"
        # at the limit: accepted
        ok = {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 1}
        ok["prompt_cache_key"] = "k" * MAX_KEY_CHARS
        assert client.post("/v1/completions", json=ok).status_code == 200


def test_engine_refuses_oversized_input_off_the_engine_thread(make_tiny_engine):
    """The same checks at the engine's own interface, and the tokenizing is not done on the
    engine thread."""
    engine = make_tiny_engine()
    with pytest.raises(InvalidRequest, match="^messages: at most"):
        engine.tokenize([{"role": "user", "content": ""}] * (MAX_MESSAGES + 1))
    with pytest.raises(ContextLengthExceeded, match="^messages: the rendered chat"):
        engine.tokenize([{"role": "user", "content": ""}] * MAX_MESSAGES)
    with pytest.raises(InvalidRequest, match="^session_id: at most"):
        RequestOptions(session_id="k" * (MAX_KEY_CHARS + 1))
    async_engine = AsyncEngine(engine)
    seen: list[str] = []
    encode = engine.tokenizer.encode

    def spy(text, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)

    engine.tokenizer.encode = spy
    async_engine.start()
    try:
        import asyncio

        async def main():
            stream = await async_engine.add_request([{"role": "user", "content": "Hi"}], GREEDY)
            return [out async for out in stream][-1]

        final = asyncio.run(main())
        assert final.finished and final.num_prompt_tokens > 0
        assert seen and all(name.startswith("kvwise-tokenize") for name in seen), seen
    finally:
        async_engine.shutdown()
        engine.tokenizer.encode = encode


def test_a_caller_flooding_invalid_requests_is_refused_before_its_body_is_read():
    """``kvwise serve``'s invalid-request budget: past it, a tenant's requests get a 429 at
    once (its body unread), while another tenant's requests are served as before."""
    from tests.fakes import fake_engine
    from tests.server.fake_http import MODEL, serve

    budget = InvalidRequestBudget(capacity=5, refill_per_s=1.0, hold_s=0.05)
    with serve(fake_engine(), api_keys=KEYS, invalid_request_budget=budget) as (server, _):
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            statuses = []
            for _ in range(12):
                r = client.post("/v1/completions", headers=BOB, json={"model": MODEL, "prompt": ""})
                statuses.append(r.status_code)
            assert statuses[:5] == [400] * 5 and set(statuses[5:]) == {429}, statuses
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "invalid_request_budget"
            assert r.headers["connection"] == "close"
            good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
            assert client.post("/v1/completions", headers=ALICE, json=good).status_code == 200
            # a huge bad body costs more of the budget than a small one
            budget2 = InvalidRequestBudget(capacity=5, refill_per_s=1.0)
            budget2.charge("x", 413, 8 * 2**20)
            assert budget2.retry_after_s("x") is not None
            budget2.charge("y", 200, 8 * 2**20)  # served requests cost nothing
            assert budget2.retry_after_s("y") is None

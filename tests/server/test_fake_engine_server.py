"""The async engine and the HTTP app over whole fake engines (``tests/fakes.py``: the fake runner
and a byte tokenizer, no model, milliseconds a test).

What holds here: a streamed request's tokens are the synchronous engine's, preemption
included; the HTTP routes (completions and chat, streamed or not) answer the engine's text
with the cached-token count; errors reach the client by type (429 with Retry-After, 400
naming the field, 404 / 409 from park, 500 or an error event from a failing step); a client
that goes away has its request aborted before the next step; tenants never share a cache. (A tier
kind registered by a plug-in: ``test_fake_tier_plugin.py``.)

Timing is made deterministic with ``ControlledRunner``, built into the engine: the test shuts
the step gate, lets steps through one at a time and knows where the engine thread stands.
NOTE: while a step waits at the shut gate the engine thread waits with it, so an admission
or a park (commands run between two steps) completes only once a step is let through
(``step_until``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from contextlib import ExitStack

import httpx

from kvwise.engine.async_engine import AsyncEngine
from kvwise.server import create_app
from kvwise.server.serving import DrainingServer
from tests.fakes import ByteTokenizer, ControlledRunner, fake_engine

from .conftest import LiveServer, wait_for
from .fake_http import (
    CHAT,
    LONG,
    MODEL,
    PROMPTS,
    P,
    cached_tokens,
    chat,
    completion,
    events,
    fresh_stats,
    run_sync,
    scrape,
    serve,
    step_until,
)

# ---- the async engine ------------------------------------------------------------------------


def test_async_streams_equal_the_synchronous_engine():
    prompts = [*PROMPTS[:3], CHAT]
    expected = run_sync(fake_engine(), prompts)
    async_engine = AsyncEngine(fake_engine())
    async_engine.start()

    async def run_one(prompt):
        outs = [out async for out in async_engine.generate(prompt, P)]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.delta_text for o in outs) == outs[-1].text
        return outs[-1]

    async def main():
        return await asyncio.gather(*(run_one(p) for p in prompts))

    try:
        got = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert all(len(o.token_ids) == 12 for o in got)


def test_stats_stay_fresh_while_the_engine_is_idle():
    # the tiers change after the last step (the writer is still writing): the gauges that
    # /metrics reads must follow without another request
    engine = fake_engine(kv_host_memory="1MiB", kv_store_min_tokens=8)
    async_engine = AsyncEngine(engine, idle_refresh_s=0.05)
    async_engine.start()
    try:
        host = engine.store.tiers[0]
        assert wait_for(lambda: async_engine.stats().num_running == 0)
        before = async_engine.stats().store.tiers["host"].num_entries
        host.put([(bytes(32), b"an entry written while the engine is idle")])
        assert wait_for(
            lambda: async_engine.stats().store.tiers["host"].num_entries == before + 1,
            timeout=2.0,
        )
    finally:
        async_engine.shutdown()


def test_async_preemption_keeps_every_answer_and_frees_every_block():
    roomy = run_sync(fake_engine(num_blocks=512), PROMPTS)
    tight_sync = fake_engine(num_blocks=24, max_num_batched_tokens=64)
    run_sync(tight_sync, PROMPTS)
    engine = fake_engine(num_blocks=24, max_num_batched_tokens=64)
    async_engine = AsyncEngine(engine)

    async def main():
        adds = [asyncio.ensure_future(async_engine.add_request(p, P)) for p in PROMPTS]
        # the prompts are tokenized off the engine thread; once every admission is posted,
        # the loop admits them in one batch
        while len(async_engine._commands) < len(PROMPTS):
            await asyncio.sleep(0.005)
        async_engine.start()
        streams = await asyncio.gather(*adds)
        finals = []
        for stream in streams:
            finals.append([out async for out in stream][-1])
        return finals, await async_engine.call(lambda e: e.stats())

    try:
        finals, stats = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert [o.token_ids for o in finals] == [o.token_ids for o in roomy]
    # admitted in one batch, the async engine schedules exactly as the synchronous one
    assert stats.num_preemptions == tight_sync.stats().num_preemptions > 0
    assert stats.kv.blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    engine.check_integrity()


# ---- the HTTP app: generation ----------------------------------------------------------------


def test_completions_streamed_equal_non_streamed_and_the_repeat_is_cached():
    expected = run_sync(fake_engine(), [LONG])[0]
    with serve(fake_engine()) as (server, client):
        first = client.post("/v1/completions", json=completion(LONG))
        assert first.status_code == 200, first.text
        body = first.json()
        assert body["choices"][0]["text"] == expected.text
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == len(LONG) and cached_tokens(body) == 0
        assert body["usage"]["completion_tokens"] == 12
        streamed = completion(LONG, stream=True, stream_options={"include_usage": True})
        with client.stream("POST", "/v1/completions", json=streamed) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            got = events(response)
        assert got[-1] == "[DONE]"
        chunks, usage = got[:-2], got[-2]["usage"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens_details"]["cached_tokens"] == (len(LONG) - 1) // 4 * 4
        assert fresh_stats(server).kv.blocks_used == 0


def test_chat_streamed_equals_non_streamed_and_the_repeat_is_cached():
    expected = run_sync(fake_engine(), [CHAT])[0]
    with serve(fake_engine()) as (_, client):
        first = client.post("/v1/chat/completions", json=chat(CHAT))
        assert first.status_code == 200, first.text
        body = first.json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
        assert cached_tokens(body) == 0
        streamed = chat(CHAT, stream=True, stream_options={"include_usage": True})
        with client.stream("POST", "/v1/chat/completions", json=streamed) as response:
            got = events(response)
        assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert got[-1] == "[DONE]"
        chunks, usage = got[1:-2], got[-2]["usage"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == expected.text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        assert usage["completion_tokens"] == 12


def test_tenants_never_share_a_cache():
    keys = {"ka": "alice", "kb": "bob"}
    with serve(fake_engine(), api_keys=keys) as (_, client):
        assert client.post("/v1/completions", json=completion(LONG)).status_code == 401

        def post(key: str) -> dict:
            response = client.post(
                "/v1/completions",
                json=completion(LONG),
                headers={"Authorization": f"Bearer {key}"},
            )
            assert response.status_code == 200, response.text
            return response.json()

        alice = [post("ka"), post("ka")]
        bob = post("kb")
    assert cached_tokens(alice[1]) > 0
    assert cached_tokens(bob) == 0
    assert bob["choices"][0]["text"] == alice[0]["choices"][0]["text"]  # one model, one answer


def test_a_prompt_over_the_context_is_400_naming_the_field():
    with serve(fake_engine(max_model_len=64)) as (server, client):
        response = client.post("/v1/completions", json=completion("x" * 100))
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert response.json()["error"]["param"] == "prompt"
        messages = [{"role": "user", "content": "x" * 100}]
        response = client.post("/v1/chat/completions", json=chat(messages, stream=True))
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert response.json()["error"]["param"] == "messages"
        assert client.post("/v1/completions", json=completion("short")).status_code == 200
        assert fresh_stats(server).num_waiting == 0


def test_invalid_unicode_is_400_naming_the_field_and_the_connection_lives_on():
    # a lone surrogate is valid JSON (an escape) but no text: it must never reach a tokenizer
    # or an error message (either would fail to encode: a 500 and a dropped connection)
    cases = [
        ("/v1/completions", completion("\\ud800 hello"), "prompt"),
        ("/v1/completions", {**completion("hi"), "model": "\\ud800"}, "model"),
        ("/v1/completions", completion("hi", stop=["ok", "\\udfff"]), "stop[1]"),
        ("/v1/chat/completions", chat([{"role": "user", "content": "a\\ud800"}]),
         "messages[0].content"),
        ("/v1/kvwise/park", {"prompt_cache_key": "\\ud800"}, "prompt_cache_key"),
    ]  # fmt: skip
    with serve(fake_engine()) as (_, client):
        for route, body, param in cases:
            raw = json.dumps(body).replace("\\\\u", "\\u").encode()  # keep the escape
            response = client.post(route, content=raw, headers={"content-type": "application/json"})
            assert response.status_code == 400, (route, response.text)
            error = response.json()["error"]
            assert error["param"] == param and "unicode" in error["message"].lower(), error
            assert client.post("/v1/completions", json=completion("fine")).status_code == 200
        # the fast look at the raw body: upper-case escapes, the UTF-8 bytes of a surrogate
        # (json.loads decodes them with surrogatepass), and a valid pair that is no surrogate
        for raw, status in ((b'{"model": "fake", "prompt": "\\uD800"}', 400),
                            (b'{"model": "fake", "prompt": "a\xed\xa0\x80"}', 400),
                            (b'{"model": "fake", "prompt": "\\ud83d\\ude00"}', 200)):  # fmt: skip
            response = client.post("/v1/completions", content=raw,
                                   headers={"content-type": "application/json"})  # fmt: skip
            assert response.status_code == status, (raw, response.text)


def test_a_body_over_the_limit_is_413_before_it_is_parsed():
    with serve(fake_engine(), max_request_bytes=4096) as (server, client):
        big = completion("x" * 5000)
        response = client.post("/v1/completions", json=big)  # refused by its Content-Length
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and "4096 bytes" in error["message"]

        def chunks():  # no Content-Length: refused once the bytes pass the limit
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i : i + 1000]

        response = client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert response.status_code == 413
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=completion("x" * 200)).status_code == 200
        assert fresh_stats(server).num_waiting == 0


def test_health_answers_in_milliseconds_while_a_huge_prompt_is_refused():
    """Issue 10: a 20 MB prompt used to stall /health for 23 s (tokenized on the event loop).
    Now text longer than the context could hold is refused before it is tokenized."""
    with serve(fake_engine()) as (server, client):
        huge = completion("x" * 6_000_000)  # under the 8 MiB body limit
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.post, "/v1/completions", json=huge)
            latencies = []
            while not pending.done():
                response = client.get("/health")
                assert response.status_code == 200
                latencies.append(response.elapsed.total_seconds())
            refused = pending.result()
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        assert latencies and max(latencies) < 0.5, latencies


# ---- the HTTP app: backpressure, disconnects, failures --------------------------------------


def test_a_full_waiting_queue_is_429_with_retry_after():
    # one running request (held by the gate), one waiting: the queue of one is full
    engine = fake_engine(max_num_seqs=1, max_waiting=1, wrap_runner=ControlledRunner)
    runner: ControlledRunner = engine.runner
    async_engine = AsyncEngine(engine, retry_after_s=7)
    long = completion("running " * 4, max_tokens=60, stream=True)
    try:
        # exits in reverse: streams, the server (and the gate), then the pool's threads
        with (
            concurrent.futures.ThreadPoolExecutor(2) as pool,
            serve(async_engine) as (_, client),
            ExitStack() as streams,
        ):
            runner.close_gate()
            running = streams.enter_context(client.stream("POST", "/v1/completions", json=long))
            assert runner.wait_until_blocked()  # admitted, its first step held
            waiting = step_until(
                runner,
                pool.submit(
                    streams.enter_context,
                    client.stream("POST", "/v1/completions", json={**long, "prompt": "waits"}),
                ),
            )
            runner.allow_steps(1)  # the snapshot is taken after a step: one more
            assert runner.wait_until_blocked()
            assert async_engine.stats().num_waiting == async_engine.stats().num_running == 1
            rejected = step_until(
                runner, pool.submit(client.post, "/v1/completions", json=completion("no room"))
            )
            assert rejected.status_code == 429
            assert rejected.headers["retry-after"] == "7"
            assert rejected.json()["error"]["code"] == "queue_full"
            runner.open_gate()
            for response in (running, waiting):
                assert response.status_code == 200
                got = events(response)
                assert got[-1] == "[DONE]"
                assert got[-2]["choices"][0]["finish_reason"] == "length"
            retried = client.post("/v1/completions", json=completion("no room"))
            assert retried.status_code == 200
    finally:
        runner.open_gate()
        async_engine.shutdown()
    assert engine.stats().kv.blocks_used == 0


def test_a_client_that_goes_away_is_aborted_before_the_next_step():
    engine = fake_engine(wrap_runner=ControlledRunner)
    runner: ControlledRunner = engine.runner
    body = completion(LONG, max_tokens=200, stream=True)
    abort = ("kvwise_requests_finished_total", (("finish_reason", "abort"),))
    with serve(engine) as (server, client):
        runner.close_gate()
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert runner.wait_until_blocked()
            runner.allow_steps(3)
            assert runner.wait_until_blocked()  # 3 steps done, the 4th held
            stats = server.engine.stats()
            assert stats.num_running == 1 and stats.kv.blocks_used > 0
        # the response is closed unread: the connection goes, the server sees it
        assert wait_for(lambda: scrape(client).get(abort) == 1)
        runner.open_gate()
        assert wait_for(lambda: server.engine.stats().kv.blocks_used == 0)
        assert server.engine.stats().num_running == 0
        # the held step ended, then the abort ran: no step after it (200 tokens were asked)
        assert runner.num_steps == 4


def test_a_failing_step_fails_its_requests_and_the_server_goes_on():
    engine = fake_engine(wrap_runner=ControlledRunner)
    runner: ControlledRunner = engine.runner
    expected = run_sync(fake_engine(), [LONG])[0]
    with serve(engine) as (server, client):
        runner.fail_step(message="boom")
        with client.stream("POST", "/v1/completions", json=completion(LONG, stream=True)) as r:
            got = events(r)
        assert got[-1] == "[DONE]"  # the error event ends the stream
        error = got[-2]["error"]
        assert error["code"] == "engine_error" and "boom" in error["message"]
        runner.fail_step(message="boom again")
        failed = client.post("/v1/chat/completions", json=chat(CHAT))
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == "engine_error"
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/completions", json=completion(LONG))
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected.text
        assert fresh_stats(server).kv.blocks_used == 0


# ---- the HTTP app: park ---------------------------------------------------------------------


def test_park_errors_then_parks_and_the_next_turn_loads_it_back():
    engine = fake_engine(
        kv_host_memory="1MiB",
        kv_store_min_tokens=8,
        kv_load_policy="always",
        wrap_runner=ControlledRunner,
    )
    runner: ControlledRunner = engine.runner
    key = {"prompt_cache_key": "conv-1"}
    # exits in reverse: the server (and the gate) before the pool waits for its threads
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        serve(engine) as (server, client),
    ):
        unknown = client.post("/v1/kvwise/park", json=key)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "session_not_found"
        assert unknown.json()["error"]["param"] == "prompt_cache_key"

        turn1 = client.post("/v1/chat/completions", json=chat(CHAT, **key))
        assert turn1.status_code == 200
        turn2 = [
            *CHAT,
            {"role": "assistant", "content": turn1.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And then?"},
        ]
        runner.close_gate()
        body = chat(turn2, max_tokens=60, stream=True, **key)
        with client.stream("POST", "/v1/chat/completions", json=body) as in_flight:
            assert runner.wait_until_blocked()
            busy = step_until(runner, pool.submit(client.post, "/v1/kvwise/park", json=key))
            assert busy.status_code == 409
            assert busy.json()["error"]["code"] == "session_busy"
            runner.open_gate()
            assert events(in_flight)[-1] == "[DONE]"

        blocks_cached = fresh_stats(server).kv.blocks_cached_free
        parked = client.post("/v1/kvwise/park", json=key)
        assert parked.status_code == 200, parked.text
        num_parked = parked.json()["parked_tokens"]
        assert num_parked > 0 and num_parked % 4 == 0
        assert parked.json()["prompt_cache_key"] == "conv-1"
        stats = fresh_stats(server)
        assert stats.kv.blocks_cached_free == blocks_cached - num_parked // 4

        # turn 2's prompt is a prefix of turn 3's (its reply, bytes of any value, may not
        # survive a UTF-8 round trip: "ok" stands in for it)
        turn3 = [
            *turn2,
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "?"},
        ]
        third = client.post("/v1/chat/completions", json=chat(turn3, **key))
        assert third.status_code == 200
        prompt2 = ByteTokenizer().encode_chat(turn2)
        assert len(prompt2) // 4 * 4 <= cached_tokens(third.json()) <= num_parked
        assert fresh_stats(server).store.tiers["host"].hits > 0  # loaded back
    expected = run_sync(fake_engine(), [turn3])[0]
    assert third.json()["choices"][0]["message"]["content"] == expected.text


def test_streams_open_at_shutdown_end_with_an_error_event_not_a_cut_body():
    engine = fake_engine(wrap_runner=ControlledRunner)
    engine.runner.delay_s = 0.02  # 200 tokens: a 4 s stream, past the 1 s shutdown timeout
    app = create_app(engine, model_name=MODEL)
    server = LiveServer(app, graceful_s=1.0, server_cls=DrainingServer)
    with server, httpx.Client(base_url=server.base_url, timeout=10) as client:
        body = completion("a long story", max_tokens=200, stream=True)
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # streaming
            server.server.should_exit = True  # what SIGTERM does
            rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "engine_down" and "shut down" in error["message"]

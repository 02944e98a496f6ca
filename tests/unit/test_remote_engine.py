"""RemoteEngine (the ingress side of the Ray deployment) over a fake transport: routing hints,
errors rebuilt by type across the process boundary, retries before admission, a replica lost
mid-request, sessions parked where they ran, and many replicas' stats as one. No Ray here."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from fastapi.testclient import TestClient

from kvwise.cluster.remote import (
    ADMITTED,
    RemoteEngine,
    ReplicaHeader,
    ReplicaSpec,
    error_from_wire,
    error_to_wire,
    merge_stats,
)
from kvwise.core.hashing import BlockHasher
from kvwise.core.kv_stats import KVCacheStats
from kvwise.engine.stats import EngineStats
from kvwise.errors import (
    ContextLengthExceeded,
    EngineDeadError,
    InvalidRequest,
    QueueFullError,
    ReplicaFailedError,
    SessionNotFound,
)
from kvwise.server.app import create_app
from kvwise.store.stats import StoreStats, TierStats
from kvwise.types import FinishReason, RequestMetrics, RequestOptions, RequestOutput, SamplingParams


class ReplicaDied(Exception):
    pass


class FakeTokenizer:
    eos_token_ids = frozenset({0})
    max_token_chars = 8

    def encode(self, text: str) -> list[int]:
        return [1 + (ord(c) % 50) for c in text]

    def encode_chat(self, messages, add_generation_prompt=True, *, max_chars=None, tools=None,
                    answers=None):  # fmt: skip
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ",".join(map(str, ids))


def _output(request_id: str, finished: bool, text: str = "x") -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=[],
        text=text,
        token_ids=[5],
        logprobs=[],
        finished=finished,
        finish_reason=FinishReason.LENGTH if finished else None,
        num_prompt_tokens=40,
        num_cached_tokens=32,
        num_kv_rows_projected=8,
        metrics=RequestMetrics(arrival_time=0.0),
        delta_text=text,
    )


class FakeTransport:
    """Replicas ``r1``/``r2``; ``script`` says what the next calls do."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.script: list[str] = []
        self.cancelled: list[str] = []

    async def spec(self) -> ReplicaSpec:
        return ReplicaSpec(BlockHasher("model", 16), vocab_size=100, max_model_len=256)

    def is_replica_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, ReplicaDied)

    def generate(self, token_ids, params, options, request_id, route):
        self.calls.append(("generate", route))
        action = self.script.pop(0) if self.script else "ok"
        transport = self

        async def items():
            if action == "die-before":
                raise ReplicaDied("actor died")
            if action == "queue-full":
                yield error_to_wire(QueueFullError(3))
                return
            yield (ADMITTED, "r1")
            yield _output(request_id, False)
            if action == "die-during":
                raise ReplicaDied("actor died")
            yield _output(request_id, True)

        gen = items()

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                return await gen.__anext__()

            def cancel(self):
                transport.cancelled.append(request_id)

        return Stream()

    async def park(self, session_id, tenant, route):
        self.calls.append(("park", route))
        return 48


def _engine(transport=None, **kwargs) -> RemoteEngine:
    return RemoteEngine(transport or FakeTransport(), FakeTokenizer(), **kwargs)


def _run(coro):
    return asyncio.run(coro)


async def _collect(stream):
    return [out async for out in stream]


def test_route_hint_is_the_engines_chain_for_the_tenant():
    transport = FakeTransport()
    engine = _engine(transport)
    prompt = "a" * 40

    async def go(tenant):
        stream = await engine.add_request(prompt, SamplingParams(), RequestOptions(tenant=tenant))
        await _collect(stream)

    _run(go("alice"))
    _run(go("bob"))
    hasher = BlockHasher("model", 16)
    ids = FakeTokenizer().encode(prompt)
    alice, bob = (call[1] for call in transport.calls)
    assert alice.chain == tuple(hasher.chain(ids, "alice")) and len(alice.chain) == 2
    assert alice.num_tokens == 40
    assert set(alice.chain).isdisjoint(bob.chain)  # another tenant hashes apart


def test_tokenize_and_detokenize_at_the_ingress_ask_no_replica():
    transport = FakeTransport()
    engine = _engine(transport)
    assert _run(engine.tokenize("abc", "alice")) == FakeTokenizer().encode("abc")
    chat = [{"role": "user", "content": "ab"}]
    assert _run(engine.tokenize(chat)) == FakeTokenizer().encode("ab")
    assert _run(engine.detokenize([1, 99])) == "1,99"
    with pytest.raises(InvalidRequest, match=r"^token_ids: must be in \[0, 100\)"):
        _run(engine.detokenize([100]))
    with pytest.raises(ContextLengthExceeded):  # refused as add_request refuses it
        _run(engine.tokenize("x" * 3000))
    assert transport.calls == []


def test_errors_cross_the_boundary_by_type():
    for exc in (
        ContextLengthExceeded("prompt", "too long"),
        SessionNotFound("session_id", "none"),
        QueueFullError(7),
        EngineDeadError("down"),
    ):
        back = error_from_wire(error_to_wire(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
        assert back.status == exc.status and back.param == exc.param
    assert error_from_wire(error_to_wire(QueueFullError(7))).retry_after_s == 7


def test_retry_before_admission_then_replica_lost_mid_stream():
    transport = FakeTransport()
    engine = _engine(transport, admission_retries=1)

    async def go():
        transport.script = ["die-before", "ok"]
        out = await _collect(await engine.add_request("hello", SamplingParams()))
        assert out[-1].finished and len(transport.calls) == 2
        transport.script = ["die-before", "die-before"]
        with pytest.raises(ReplicaFailedError):
            await engine.add_request("hello", SamplingParams())
        transport.script = ["die-during"]
        stream = await engine.add_request("hello", SamplingParams())
        with pytest.raises(ReplicaFailedError, match="retry"):
            await _collect(stream)
        transport.script = ["queue-full"]
        with pytest.raises(QueueFullError):
            await engine.add_request("hello", SamplingParams())

    _run(go())


def test_closing_an_unfinished_stream_cancels_it():
    transport = FakeTransport()
    engine = _engine(transport)

    async def go():
        stream = await engine.add_request("hello", SamplingParams(), request_id="r-9")
        await stream.__anext__()
        stream.close()
        stream.close()

    _run(go())
    assert transport.cancelled == ["r-9"]


def test_sessions_park_on_the_replica_that_served_them():
    transport = FakeTransport()
    engine = _engine(transport)

    async def go():
        with pytest.raises(SessionNotFound):
            await engine.park("chat-1", "alice")
        options = RequestOptions(tenant="alice", session_id="chat-1")
        await _collect(await engine.add_request("hello", SamplingParams(), options))
        assert await engine.park("chat-1", "alice") == 48
        with pytest.raises(SessionNotFound):
            await engine.park("chat-1", "bob")  # the key is the tenant's

    _run(go())
    kind, route = transport.calls[-1]
    assert kind == "park" and route.pin == "r1"


def test_the_app_over_a_remote_engine_names_the_replica():
    transport = FakeTransport()
    app = create_app(_engine(transport), api_keys={"k": "alice"})
    app.add_middleware(ReplicaHeader)
    with TestClient(app) as client:
        auth = {"Authorization": "Bearer k"}
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvwise-replica"] == "r1"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        transport.script = ["queue-full"]
        r = client.post("/v1/completions", json={"prompt": "hi"}, headers=auth)
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        r = client.post("/v1/completions", json={"prompt": "hi" * 1100}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 401


def test_merge_stats_sums_replicas():
    def stats(used: int, hits: int, utilization: float) -> EngineStats:
        kv = KVCacheStats(100, used, 0, 100 - used, 0, 50, hits, utilization)
        store = StoreStats(1, 2, 3, 4, 5, 6, 7, {"host": TierStats(hits=hits)})
        return EngineStats(1, 2, 0, 0, kv, store, kv_integrity_checks=3)

    merged = merge_stats([stats(10, 4, 0.5), stats(30, 6, 1.0)])
    assert merged.kv.blocks_total == 200 and merged.kv.blocks_used == 40
    assert merged.kv.prefix_hit_tokens == 10 and merged.kv.utilization == 0.75
    assert merged.store.tiers["host"].hits == 10 and merged.store.loaded_tokens == 8
    assert merged.num_running == 2 and merged.kv_integrity_checks == 6
    assert merge_stats([]) is None
    assert dataclasses.asdict(merge_stats([stats(1, 1, 0.1)])) == dataclasses.asdict(
        stats(1, 1, 0.1)
    )


def test_the_dashboard_over_a_remote_engine_draws_a_replicas_cost_model():
    from kvwise.store.costmodel import CostCurves, TierCurve

    def curves(break_even: int) -> CostCurves:
        tier = TierCurve("disk", (0.04, 0.05), break_even, 3)
        return CostCurves((16, 32), (0.06, 0.09), (tier,), 7, policy="auto")

    published: dict[str, CostCurves] = {}

    async def replica_stats():
        return {"r1": EngineStats(0, 0, 0, 0, KVCacheStats(100, 0, 0, 100, 0, 0, 0, 0.0))}

    async def replica_curves():
        return dict(published)

    engine = _engine(replica_stats=replica_stats, replica_curves=replica_curves,
                     stats_interval_s=0.05)  # fmt: skip
    assert engine.cost_curves() is None  # nothing polled yet
    app = create_app(engine)
    with TestClient(app) as client:
        time.sleep(0.2)
        assert client.get("/dashboard/data").json()["cost_model"] is None  # none published
        published.update({"r2": curves(48), "r1": curves(16)})
        time.sleep(0.2)
        model = client.get("/dashboard/data").json()["cost_model"]
        assert model["policy"] == "auto" and model["prefix_tokens"] == [16, 32]
        assert model["tiers"][0]["break_even_tokens"] == 16  # r1's: the first by name
        assert "kvwise_kv_tier_break_even_tokens" in client.get("/metrics").text

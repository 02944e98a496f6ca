"""Both engines the server serves implement ``EngineClient`` (the protocol, signatures included),
and the server calls nothing on an engine that the protocol does not name. No torch: the fake
engine and a fake transport."""

from __future__ import annotations

import asyncio
import inspect
import time
import typing

import pytest
from fastapi.testclient import TestClient

from kvwise.cluster.remote import RemoteEngine, ReplicaSpec
from kvwise.core.hashing import BlockHasher
from kvwise.engine.async_engine import AsyncEngine
from kvwise.engine.client import EngineClient, RequestStream
from kvwise.server import routes
from kvwise.server.app import create_app
from kvwise.server.tools import _new_call
from tests.fakes import ByteTokenizer, fake_engine


class SpecOnly:
    """A transport that only answers ``spec`` (enough for the protocol's members)."""

    async def spec(self) -> ReplicaSpec:
        return ReplicaSpec(BlockHasher("model", 4), vocab_size=256, max_model_len=128)


def protocol_members() -> dict[str, object]:
    """The protocol's members by name: its methods and properties."""
    return {
        name: value
        for name, value in vars(EngineClient).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


_MISSING = object()


def mismatches(engine: object) -> list[str]:
    """How ``engine`` departs from the protocol: a member missing or of another kind (property
    vs method, async vs plain), a parameter renamed, reordered, of another kind, or a default
    missing or different."""
    problems = []
    for name, member in protocol_members().items():
        impl = inspect.getattr_static(engine, name, _MISSING)  # an instance attribute counts
        if isinstance(member, property):
            if impl is _MISSING:
                problems.append(f"{name}: missing")
            elif callable(impl):
                problems.append(f"{name}: a method, the protocol's is a property")
            continue
        if not callable(impl) or isinstance(impl, property):
            problems.append(f"{name}: missing or not a method")
            continue
        if inspect.iscoroutinefunction(member) != inspect.iscoroutinefunction(impl):
            problems.append(f"{name}: async in one, not in the other")
        want = list(inspect.signature(member).parameters.values())
        got = list(inspect.signature(impl).parameters.values())
        if [(p.name, p.kind) for p in want] != [(p.name, p.kind) for p in got]:
            problems.append(f"{name}: parameters {got} where the protocol has {want}")
            continue
        for w, g in zip(want, got):
            if w.default is not g.default and w.default != g.default:
                problems.append(f"{name}: {g.name} defaults to {g.default!r}, not {w.default!r}")
    return problems


@pytest.fixture
def engines():
    async_engine = AsyncEngine(fake_engine())
    remote = RemoteEngine(SpecOnly(), ByteTokenizer())
    asyncio.run(remote.ensure_spec())  # NOTE: max_model_len raises until a replica answered
    yield async_engine, remote
    async_engine.shutdown()


def test_both_engines_are_engine_clients(engines):
    for engine in engines:
        assert isinstance(engine, EngineClient), type(engine).__name__
        assert mismatches(engine) == [], type(engine).__name__


def test_add_request_returns_a_request_stream():
    for cls in (AsyncEngine, RemoteEngine):
        returned = typing.get_type_hints(cls.add_request)["return"]
        assert issubclass(returned, RequestStream), cls.__name__


class Minimal:
    """The protocol, member for member, doing nothing."""

    max_model_len = 16
    is_running = True
    dead_reason = None

    def start(self) -> None: ...
    def stop(self) -> None: ...
    async def add_request(self, prompt, params, options=None, *, request_id=None): ...
    async def park(self, session_id: str, tenant: str = "default") -> int: ...
    async def tool_pause(self, request_id: str) -> int: ...
    async def tokenize(self, prompt, tenant: str = "default") -> list[int]: ...
    async def detokenize(self, token_ids) -> str: ...
    def stats(self): ...
    def cost_curves(self): ...


def test_the_check_sees_a_departure():
    class Renamed(Minimal):
        async def park(self, session: str, tenant: str = "default") -> int: ...

    class OtherDefault(Minimal):
        async def park(self, session_id: str, tenant: str = "alice") -> int: ...

    class Blocking(Minimal):
        def park(self, session_id: str, tenant: str = "default") -> int: ...

    class Positional(Minimal):
        async def add_request(self, prompt, params, options=None, request_id=None): ...

    class NoCurves(Minimal):
        cost_curves = None

    assert isinstance(Minimal(), EngineClient) and mismatches(Minimal()) == []
    (renamed,) = mismatches(Renamed())
    assert renamed.startswith("park: parameters")
    assert mismatches(OtherDefault()) == ["park: tenant defaults to 'alice', not 'default'"]
    assert mismatches(Blocking()) == ["park: async in one, not in the other"]
    (positional,) = mismatches(Positional())
    assert positional.startswith("add_request: parameters")
    assert mismatches(NoCurves()) == ["cost_curves: missing or not a method"]
    assert not isinstance(NoCurves(), EngineClient)


class OnlyTheProtocol:
    """An engine that answers only what ``EngineClient`` names (anything else: AttributeError),
    to show that the server needs nothing more."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.asked: set[str] = set()

    def __getattr__(self, name: str):
        if name not in protocol_members():
            raise AttributeError(f"the server asked for {name!r}, which EngineClient lacks")
        self.asked.add(name)
        return getattr(self._engine, name)


def test_the_server_calls_only_the_protocol(monkeypatch):
    # the fake model writes no tool call: its answers are read as one, so that the turn
    # ends in tool calls and the server asks for a tool pause
    monkeypatch.setattr(routes, "_answer", lambda out, names: (None, [_new_call("look", "{}")]))
    monkeypatch.setattr(routes, "_cut", lambda out: False)  # (not cut by max_tokens)
    engine = AsyncEngine(fake_engine(kv_host_memory="1MiB"))
    only = OnlyTheProtocol(engine)
    app = create_app(only)
    try:
        with TestClient(app) as client:
            body = {"prompt": "hello there", "max_tokens": 3, "prompt_cache_key": "s1"}
            assert client.post("/v1/completions", json=body).status_code == 200
            streamed = client.post("/v1/completions", json={**body, "stream": True})
            assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            answer = client.post("/v1/chat/completions", json=chat).json()
            assert answer["choices"][0]["finish_reason"] == "tool_calls"
            park = client.post("/v1/kvwise/park", json={"prompt_cache_key": "s1"})
            assert park.status_code == 200, park.text
            tokens = client.post("/tokenize", json={"prompt": "hello"}).json()["tokens"]
            text = client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
            assert text == "hello"
            assert client.get("/health").status_code == 200
            assert client.get("/metrics").status_code == 200
            assert client.get("/dashboard/data").status_code == 200
            only.stop()  # as the draining server does
            deadline = time.monotonic() + 10
            while (health := client.get("/health")).status_code == 200:
                assert time.monotonic() < deadline, "the engine did not stop"
                time.sleep(0.01)
            assert health.status_code == 503 and "shut down" in health.json()["status"]
    finally:
        engine.shutdown()
    assert only.asked == set(protocol_members())

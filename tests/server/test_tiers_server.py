"""KV tiers over HTTP on the tiny model: conversations named by ``prompt_cache_key``, parked with
``POST /v1/kvwise/park`` and loaded back from the host tier on their next turn (the same greedy
text as without tiers), per-tier metrics, the ``KV tiers`` flags, and the flush of pending tier
writes on shutdown (in process, and ``kvwise serve`` on SIGTERM)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvwise.cli import build_parser, engine_kwargs, main
from kvwise.config import EngineConfig, StoreConfig
from kvwise.engine.async_engine import AsyncEngine
from kvwise.server import create_app
from kvwise.types import SamplingParams
from tests.fakes import ControlledRunner

from .conftest import (
    KEYS,
    TINY_NAME,
    LiveServer,
    stop_serving,
    wait_for,
    wait_until_serving,
)

ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
# store every sequence of a block or more, and load whatever is stored (no cost model)
TIERS = {"kv_host_memory": "64MiB", "kv_store_min_tokens": 16, "kv_load_policy": "always"}
TIER_FLAGS = (
    "--kv-host-memory",
    "--kv-disk-path",
    "--kv-disk-size",
    "--kv-redis-url",
    "--kv-redis-ttl",
    "--kv-redis-timeout",
    "--kv-chunk-blocks",
    "--kv-store-min-tokens",
    "--kv-load-policy",
)


def document(topic: str) -> str:
    """A system prompt of about a hundred tokens, different per topic."""
    colours = ["red", "blue", "green", "white", "black", "gold"]
    return f"Inventory of the {topic} shelf. " + " ".join(
        f"Box {i} is {c}." for i, c in enumerate(colours * 2)
    )


@pytest.fixture(scope="module")
def tier_server(make_tiny_engine):
    """The tiny model with a host tier, behind the two API keys of KEYS."""
    app = create_app(make_tiny_engine(**TIERS), api_keys=KEYS, model_name=TINY_NAME)
    with LiveServer(app) as server:
        yield server


def client_for(server, key: str = "key-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=30)


def chat(client: openai.OpenAI, messages: list[dict], session: str):
    return client.chat.completions.create(
        model=TINY_NAME,
        messages=messages,
        max_tokens=6,
        temperature=0,
        prompt_cache_key=session,
        extra_body={"ignore_eos": True},
    )


def park(server, session: str, headers: dict | None = ALICE) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/kvwise/park",
        json={"prompt_cache_key": session},
        headers=headers,
        timeout=30,
    )


def conversation(server, session: str, *, park_between: bool) -> tuple[list, int | None]:
    """Two turns of one conversation; parks it between them if asked (returns parked tokens)."""
    client = client_for(server)
    messages = [
        {"role": "system", "content": document(session)},
        {"role": "user", "content": "Which box is red?"},
    ]
    first = chat(client, messages, session)
    parked = None
    if park_between:
        r = park(server, session)
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "kvwise.park" and r.json()["prompt_cache_key"] == session
        parked = r.json()["parked_tokens"]
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And which one is gold?"},
    ]
    second = chat(client, messages, session)
    return [first, second], parked


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus exposition (0 if absent)."""
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = "^" + re.escape(name + (f"{{{selector}}}" if labels else "")) + r" (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def used_blocks(server) -> int:
    return server.engine.call_sync(lambda e: e.kv_manager.pool.num_used_blocks)


# ---- sessions and park ---------------------------------------------------------------------


def test_parked_turn_is_loaded_back_with_the_same_text(tier_server, tiny_server):
    before = httpx.get(tier_server.base_url + "/metrics").text
    turns, parked = conversation(tier_server, "conv-load", park_between=True)
    # the device pool no longer holds the first turn: the second loads it from the host tier
    assert parked > 0 and parked % 16 == 0
    first, second = turns
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    after = httpx.get(tier_server.base_url + "/metrics").text
    for name in ("kvwise_kv_tier_hits_total", "kvwise_kv_tier_read_bytes_total"):
        assert metric(after, name, tier="host") > metric(before, name, tier="host"), name
    loaded = metric(after, "kvwise_kv_store_loaded_tokens_total")
    assert loaded - metric(before, "kvwise_kv_store_loaded_tokens_total") > 0
    assert metric(after, "kvwise_kv_store_decisions_total", decision="load") > 0
    # an engine without tiers (its second turn hits the device pool) writes the same text
    plain, _ = conversation(tiny_server, "conv-load", park_between=False)
    assert [t.choices[0].message.content for t in turns] == [
        t.choices[0].message.content for t in plain
    ]
    assert plain[1].usage.prompt_tokens == second.usage.prompt_tokens
    assert used_blocks(tier_server) == 0
    tier_server.engine.call_sync(lambda e: e.check_integrity())


def test_completions_carry_the_session_too(tier_server):
    client = client_for(tier_server)
    prompt = document("completions") + " The red box is"
    client.completions.create(
        model=TINY_NAME, prompt=prompt, max_tokens=2, extra_body={"prompt_cache_key": "cmpl-1"}
    )
    r = park(tier_server, "cmpl-1")
    assert r.status_code == 200 and r.json()["parked_tokens"] > 0


def test_park_errors(tier_server):
    r = park(tier_server, "never-seen")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["param"] == "prompt_cache_key" and error["code"] == "session_not_found"
    assert error["message"].startswith("prompt_cache_key: ")
    assert park(tier_server, "never-seen", headers=None).status_code == 401
    assert (
        park(tier_server, "never-seen", headers={"Authorization": "Bearer no"}).status_code == 401
    )
    url = tier_server.base_url + "/v1/kvwise/park"
    for body in ({}, {"prompt_cache_key": ""}, {"prompt_cache_key": 7}, ["x"]):
        r = httpx.post(url, json=body, headers=ALICE)
        assert r.status_code == 400, (body, r.text)
        if isinstance(body, dict):
            assert r.json()["error"]["param"] == "prompt_cache_key", r.text
    r = httpx.post(url, content=b"{not json", headers={**ALICE, "Content-Type": "application/json"})
    assert r.status_code == 400


def test_sessions_are_per_tenant(tier_server):
    client = client_for(tier_server)
    messages = [{"role": "user", "content": document("tenants")}]
    chat(client, messages, "shared-name")
    # bob names alice's conversation: it does not exist for him
    r = park(tier_server, "shared-name", headers=BOB)
    assert r.status_code == 404 and r.json()["error"]["param"] == "prompt_cache_key"
    assert park(tier_server, "shared-name").status_code == 200  # alice's own


def test_park_of_a_session_in_flight_is_409(make_tiny_engine):
    # no tier needed: the in-flight check comes first
    engine = make_tiny_engine(wrap_runner=ControlledRunner)
    app = create_app(engine, api_keys=KEYS, model_name=TINY_NAME)
    with LiveServer(app) as server:
        client = client_for(server)
        messages = [{"role": "user", "content": "Count to a hundred."}]
        chat(client, messages, "busy")
        engine.runner.delay_s = 0.02  # every step from now on
        body = {
            "messages": messages,
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
            "prompt_cache_key": "busy",
        }
        with httpx.Client(base_url=server.base_url, headers=ALICE, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200  # admitted: the request is in flight
                busy = park(server, "busy")
                assert busy.status_code == 409, busy.text
                assert busy.json()["error"]["param"] == "prompt_cache_key"
        # the stream was closed: its request is aborted, the last finished turn can be parked
        assert wait_for(lambda: used_blocks(server) == 0)
        assert park(server, "busy").status_code == 200


# ---- metrics -------------------------------------------------------------------------------


def test_metrics_has_the_tier_series(tier_server, tiny_server):
    text = httpx.get(tier_server.base_url + "/metrics").text
    for name in (
        "kvwise_kv_tier_hits_total",
        "kvwise_kv_tier_misses_total",
        "kvwise_kv_tier_read_bytes_total",
        "kvwise_kv_tier_written_bytes_total",
        "kvwise_kv_tier_load_seconds_total",
        "kvwise_kv_tier_evictions_total",
        "kvwise_kv_tier_faults_total",
        "kvwise_kv_tier_entries",
        "kvwise_kv_tier_bytes",
    ):
        assert f'{name}{{tier="host"}}' in text, name
    assert 'tier="disk"' not in text  # only the tiers configured
    assert 'kvwise_kv_store_decisions_total{decision="recompute"}' in text
    for name in (
        "kvwise_kv_store_loaded_tokens_total",
        "kvwise_kv_store_chunks_written_total",
        "kvwise_kv_store_writes_dropped_total",
        "kvwise_kv_store_pending_write_bytes",
    ):
        assert re.search(rf"^{name} \S+$", text, re.MULTILINE), name
    assert metric(text, "kvwise_kv_tier_written_bytes_total", tier="host") > 0
    assert 'kvwise_http_requests_total{route="/v1/kvwise/park"' in text
    # no tier: no tier series
    assert "kvwise_kv_tier" not in httpx.get(tiny_server.base_url + "/metrics").text


# ---- shutdown flushes the tiers ------------------------------------------------------------


def test_shutdown_flushes_pending_writes(make_tiny_engine, tmp_path, caplog):
    engine = make_tiny_engine(kv_disk_path=str(tmp_path), kv_store_min_tokens=16)
    (disk,) = engine.store.tiers
    put = disk.put

    def slow_put(*args, **kwargs):  # the write is still queued when the shutdown begins
        time.sleep(1.0)
        return put(*args, **kwargs)

    disk.put = slow_put
    async_engine = AsyncEngine(engine)
    async_engine.start()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def run() -> None:
        async for _ in async_engine.generate(document("flush"), params):
            pass

    asyncio.run(run())
    with caplog.at_level(logging.INFO, logger="kvwise"):
        async_engine.shutdown()
    assert list(tmp_path.rglob("*.kv"))
    assert "KV tiers flushed on shutdown" in caplog.text
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request("after the shutdown")
    async_engine.shutdown()  # idempotent


def test_shutdown_of_an_engine_never_started_closes_it(make_tiny_engine):
    engine = make_tiny_engine()
    AsyncEngine(engine).shutdown()
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request("after the shutdown")


# ---- the CLI -------------------------------------------------------------------------------


def test_serve_help_lists_the_tier_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "KV tiers:" in out
    for flag in TIER_FLAGS:
        assert flag in out, flag


def test_tier_flags_reach_the_store_config_only_when_given(monkeypatch, tmp_path):
    monkeypatch.delenv("KVWISE_KV_REDIS_URL", raising=False)
    kwargs = engine_kwargs(build_parser().parse_args(["serve"]))
    pool_flags = ("kv_cache_memory", "kv_cache_dtype", "kv_int4_group_size")  # the pool: not tiers
    assert not any(name.startswith("kv_") and name not in pool_flags for name in kwargs)
    assert EngineConfig.from_kwargs(**kwargs).store == StoreConfig()
    argv = ["serve", "--kv-host-memory", "off", "--kv-disk-path", str(tmp_path)]
    argv += ["--kv-disk-size", "1GiB", "--kv-redis-url", "redis://127.0.0.1:6390/2"]
    argv += ["--kv-redis-ttl", "30m", "--kv-redis-timeout", "2", "--kv-chunk-blocks", "4"]
    argv += ["--kv-store-min-tokens", "32", "--kv-load-policy", "never"]
    store = EngineConfig.from_kwargs(**engine_kwargs(build_parser().parse_args(argv))).store
    assert store == StoreConfig(
        kv_host_memory=0,
        kv_disk_path=str(tmp_path),
        kv_disk_size=1 << 30,
        kv_redis_url="redis://127.0.0.1:6390/2",
        kv_redis_ttl=1800,
        kv_redis_timeout=2,
        kv_chunk_blocks=4,
        kv_store_min_tokens=32,
        kv_load_policy="never",
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-load-policy", "sometimes"])


def test_redis_url_from_the_environment(monkeypatch, capsys):
    url = "redis://:s3cret@127.0.0.1:6390/0"
    monkeypatch.setenv("KVWISE_KV_REDIS_URL", url)
    assert engine_kwargs(build_parser().parse_args(["serve"]))["kv_redis_url"] == url
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "s3cret" not in capsys.readouterr().out  # never shown


@pytest.mark.slow
def test_serve_subprocess_flushes_to_disk_on_sigterm(tmp_path):
    port = _free_port()
    kv_dir = tmp_path / "kv"
    cmd = [sys.executable, "-m", "kvwise.cli", "serve", "--port", str(port)]
    cmd += ["--kv-cache-memory", "64MiB", "--max-model-len", "512"]
    cmd += ["--kv-host-memory", "off", "--kv-disk-path", str(kv_dir)]
    cmd += ["--kv-store-min-tokens", "32"]
    env = {
        k: v for k, v in os.environ.items() if k not in ("KVWISE_API_KEYS", "KVWISE_KV_REDIS_URL")
    }
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base)
        body = {
            "messages": [{"role": "user", "content": document("subprocess")}],
            "max_tokens": 2,
            "prompt_cache_key": "sub-1",
        }
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 32, r.text
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    log = stop_serving(proc, timeout=60)
    assert proc.returncode == 0, log
    assert "KV tiers flushed on shutdown" in log, log
    assert list(kv_dir.rglob("*.kv")), log


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""The bill per tenant over a real (tiny-model) server (issue 46, item 5): chat and
completions requests, streamed and not, n=2, echo-only, and a Messages and a Responses
request, for two tenants; each tenant's ledger
(``GET /v1/usage``) equals the sum of its responses' ``usage`` exactly, /metrics carries
``kvwise_tenant_tokens_total`` for the admin's scrape only, ``/v1/usage`` needs the admin
key, and the priced bill matches a hand computation."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwise.server import create_app

from .conftest import KEYS, TINY_NAME, LiveServer, wait_for

ADMIN = "admin-usage-secret"
PRICES = {
    "input": 3.0,
    "output": 15.0,
    "cache_read": 0.3,
    "cache_write_5m": 3.75,
    "cache_write_1h": 6.0,
}
SYSTEM = "You answer briefly. The shared context every turn repeats: " + "alpha beta " * 12


@pytest.fixture(scope="module")
def billed_server(make_tiny_engine, tmp_path_factory):
    sheet = tmp_path_factory.mktemp("prices") / "prices.json"
    sheet.write_text(json.dumps(PRICES))
    engine = make_tiny_engine(cache_min_tokens=16)  # a breakpoint caches from 16 tokens up
    app = create_app(
        engine, api_keys=KEYS, model_name=TINY_NAME, admin_key=ADMIN, price_sheet=sheet
    )
    with LiveServer(app) as server:
        yield server


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _streamed_usage(client: httpx.Client, path: str, body: dict, key: str) -> dict:
    """The closing usage chunk of a streamed answer (stream_options.include_usage)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with client.stream("POST", path, json=body, headers=_auth(key)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
    assert usage is not None
    return usage


def _requests(client: httpx.Client, key: str) -> list[dict]:
    """A tenant's mix of requests in every dialect; each answer's usage as ``prompt``,
    ``cache_read``, ``cache_write_5m``, ``cache_write_1h`` and ``output`` tokens."""
    chat = {
        "model": TINY_NAME,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
        "max_tokens": 5,
    }
    cmpl = {"model": TINY_NAME, "prompt": SYSTEM + "Go on:", "max_tokens": 4}
    openai = []
    for body in (
        {**chat, "n": 2},
        chat,
        {**cmpl, "prompt": [cmpl["prompt"], "Other"], "n": 2},
        {**cmpl, "max_tokens": 0, "echo": True},
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = client.post(path, json=body, headers=_auth(key))
        assert r.status_code == 200, r.text
        openai.append(r.json()["usage"])
    openai.append(_streamed_usage(client, "/v1/chat/completions", {**chat, "n": 2}, key))
    openai.append(_streamed_usage(client, "/v1/completions", {**cmpl, "n": 2}, key))
    usages = [_openai(u) for u in openai]
    message = {
        "model": TINY_NAME,
        "max_tokens": 5,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    r = client.post("/v1/messages", json=message, headers={"x-api-key": key})
    assert r.status_code == 200, r.text
    usages.append(_anthropic(r.json()["usage"]))
    for ttl, words in (("1h", "epsilon zeta "), ("5m", "gamma delta ")):  # cache writes
        system = [
            {
                "type": "text",
                "text": f"Kept {ttl}: " + words * 12,
                "cache_control": {"type": "ephemeral", "ttl": ttl},
            }
        ]
        r = client.post(
            "/v1/messages", json={**message, "system": system}, headers={"x-api-key": key}
        )
        assert r.status_code == 200, r.text
        usages.append(_anthropic(r.json()["usage"]))
        assert usages[-1][f"cache_write_{ttl}"] > 0, usages[-1]
    response = {"model": TINY_NAME, "instructions": SYSTEM, "input": "Hi", "max_output_tokens": 5}
    r = client.post("/v1/responses", json=response, headers=_auth(key))
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    usages.append(
        {
            "prompt": u["input_tokens"],
            "cache_read": u["input_tokens_details"]["cached_tokens"],
            "cache_write_5m": 0,
            "cache_write_1h": 0,
            "output": u["output_tokens"],
        }
    )
    return usages


def _openai(u: dict) -> dict:
    return {
        "prompt": u["prompt_tokens"],
        "cache_read": u["prompt_tokens_details"]["cached_tokens"],
        "cache_write_5m": 0,
        "cache_write_1h": 0,
        "output": u["completion_tokens"],
    }


def _anthropic(u: dict) -> dict:
    """Anthropic's usage: the three input counts add up to the prompt."""
    read, created = u["cache_read_input_tokens"], u["cache_creation_input_tokens"]
    return {
        "prompt": u["input_tokens"] + read + created,
        "cache_read": read,
        "cache_write_5m": u["cache_creation"]["ephemeral_5m_input_tokens"],
        "cache_write_1h": u["cache_creation"]["ephemeral_1h_input_tokens"],
        "output": u["output_tokens"],
    }


BILLED = {key: tenant for key, tenant in KEYS.items() if tenant in ("alice", "bob")}
SEQUENCES = 2 + 1 + 4 + 1 + 2 + 2 + 1 + 2 + 1  # the sequences (choices x prompts) of _requests


def test_each_tenants_bill_is_the_sum_of_its_usage(billed_server):
    with httpx.Client(base_url=billed_server.base_url, timeout=60) as client:
        sums = {}
        for key, tenant in BILLED.items():
            usages = _requests(client, key)
            sums[tenant] = {kind: sum(u[kind] for u in usages) for kind in usages[0]}
        assert sums["alice"]["cache_read"] > 0  # the repeated context hit the cache

        def usage(**query) -> dict:
            r = client.get("/v1/usage", params=query, headers=_auth(ADMIN))
            assert r.status_code == 200, r.text
            return r.json()

        def all_ended() -> bool:  # a stream is billed as it closes, just after [DONE]
            rows = usage()["tenants"]
            return [row["tokens"]["sequences"] for row in rows] == [SEQUENCES, SEQUENCES]

        assert wait_for(all_ended, timeout=10), usage()
        bill = usage()
        assert bill["price_sheet"] == {"currency": "USD", **PRICES}
        board = client.get("/dashboard/data", headers=_auth(ADMIN)).json()["bill"]
        assert board == {"currency": "USD", "tenants": bill["tenants"]}  # the dashboard's table
        assert [row["tenant"] for row in bill["tenants"]] == ["alice", "bob"]
        for row in bill["tenants"]:
            tokens, expected = row["tokens"], sums[row["tenant"]]
            for kind in ("prompt", "cache_read", "cache_write_5m", "cache_write_1h", "output"):
                assert tokens[kind] == expected[kind], kind
            uncached, read, out = tokens["input"], tokens["cache_read"], tokens["output"]
            w5, w1 = tokens["cache_write_5m"], tokens["cache_write_1h"]
            assert uncached == expected["prompt"] - read - w5 - w1 and w5 > 0 and w1 > 0
            # priced by hand: $ per million tokens
            cost = (uncached * 3.0 + read * 0.3 + w5 * 3.75 + w1 * 6.0 + out * 15.0) / 1e6
            assert row["cost"]["total"] == pytest.approx(cost, rel=1e-12)
            assert row["cost"]["cache_read"] == pytest.approx(read * 0.3 / 1e6, rel=1e-12)
            saved = (read * (3.0 - 0.3) - w5 * (3.75 - 3.0) - w1 * (6.0 - 3.0)) / 1e6
            assert row["saved"] == pytest.approx(saved, rel=1e-12)

        one = usage(tenant="bob", since="2020-01-01T00:00:00Z")["tenants"]
        assert one == [row for row in bill["tenants"] if row["tenant"] == "bob"]
        assert usage(tenant="carol")["tenants"][0]["tokens"]["sequences"] == 0
        future = usage(since=str(2**40))
        assert all(row["tokens"]["prompt"] == 0 for row in future["tenants"])

        # Prometheus: the admin's scrape has the bill per tenant, an anonymous one no tenant
        anonymous = client.get("/metrics").text
        assert "kvwise_tenant" not in anonymous and "alice" not in anonymous
        scraped = client.get("/metrics", headers=_auth(ADMIN)).text
        series = {
            (s.labels["tenant"], s.labels["kind"]): s.value
            for family in text_string_to_metric_families(scraped)
            if family.name == "kvwise_tenant_tokens"
            for s in family.samples
            if s.name == "kvwise_tenant_tokens_total"
        }
        for row in bill["tenants"]:
            for kind in ("input", "cache_read", "cache_write_5m", "cache_write_1h", "output"):
                assert series[(row["tenant"], kind)] == row["tokens"][kind]
        assert "kvwise_tenant" not in client.get("/metrics", headers=_auth("key-alice")).text


def test_usage_needs_the_admin_key(billed_server):
    with httpx.Client(base_url=billed_server.base_url, timeout=10) as client:
        missing = client.get("/v1/usage")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_admin_key"
        for key in KEYS:  # a tenant sees no bill, not even its own
            r = client.get("/v1/usage", headers=_auth(key))
            assert r.status_code == 403 and r.json()["error"]["code"] == "not_admin"
            assert client.get("/v1/usage", headers={"x-api-key": key}).status_code == 401
        assert client.get("/v1/usage", headers=_auth("wrong")).status_code == 401
        bad = client.get("/v1/usage", params={"since": "last week"}, headers=_auth(ADMIN))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
        # the admin key is still no tenant's key
        assert client.get("/v1/models", headers=_auth(ADMIN)).status_code == 401


@pytest.fixture(scope="module")
def slow_server(make_tiny_engine):
    """An open server (no keys: tenant ``default``, /v1/usage open) at 50 ms a step."""
    from kvwise.engine.async_engine import AsyncEngine
    from tests.fakes import ControlledRunner

    engine = make_tiny_engine(wrap_runner=ControlledRunner)
    engine.runner.delay_s = 0.05
    async_engine = AsyncEngine(engine)
    with LiveServer(create_app(async_engine, model_name=TINY_NAME)) as server:
        yield server
    async_engine.shutdown()


def test_a_hung_up_request_bills_what_it_computed_and_its_prompt_once(slow_server):
    chat = {
        "model": TINY_NAME,
        "messages": [{"role": "user", "content": "tell me a long story " * 4}],
        "ignore_eos": True,
    }
    with httpx.Client(base_url=slow_server.base_url, timeout=30) as client:
        r = client.post("/v1/chat/completions", json={**chat, "max_tokens": 1})
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        body = {**chat, "n": 2, "max_tokens": 200, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: {"))
            for _ in range(6):  # two role chunks, then tokens
                next(lines)
        # the client went away: both choices aborted, and billed once they end

        def tokens() -> dict:
            return client.get("/v1/usage").json()["tenants"][0]["tokens"]

        assert wait_for(lambda: tokens()["sequences"] == 3, timeout=10), tokens()
        bill = tokens()
    assert bill["prompt"] == 2 * prompt_tokens  # the first request's and, once, the hung-up one's
    assert 1 + 2 <= bill["output"] < 1 + 2 * 200  # some of the 400 tokens asked, not all

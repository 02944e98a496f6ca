"""GET /dashboard over whole fake engines (no model, milliseconds): the page, its script and
its JSON, the numbers the JSON carries, and who may see it (the admin key by header, query or
cookie; 401 without it, 403 for a tenant's key or when keys are set and no admin key is). The
page in a real browser against ``kvwise serve``: ``tests/browser``."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvwise.server import create_app
from kvwise.server.dashboard import COOKIE, AdminGate
from tests.fakes import fake_engine

from .conftest import wait_for
from .fake_http import LONG, completion, serve

KEYS = {"key-alice": "alice"}
ADMIN = "admin-secret"


def test_open_dashboard_serves_page_script_and_data():
    with serve(fake_engine(kv_host_memory="1MiB", kv_store_min_tokens=8)) as (server, client):
        server.app.state.dashboard.history.interval_s = 0.05  # the sampler's next sleep
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/dashboard/dashboard.js"' in page.text
        assert "http" not in page.text.split("<body>")[0].replace("http-equiv", "")  # no CDN
        assert "script-src 'self'" in page.headers["content-security-policy"]
        script = client.get("/dashboard/dashboard.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert "/dashboard/data" in script.text

        data = client.get("/dashboard/data").json()
        assert data["model"] == "fake" and data["engine_up"] is True
        assert data["now"]["requests_finished"] == 0 and data["now"]["blocks_total"] == 64
        assert list(data["series"]["hit_rate"]) == ["device pool", "host"]
        assert [t["name"] for t in data["tiers"]] == ["host"] and data["tiers"][0]["hits"] == 0
        cost = data["cost_model"]
        assert cost["policy"] == "auto" and [t["name"] for t in cost["tiers"]] == ["host"]
        n = len(cost["prefix_tokens"])
        assert n > 10 and len(cost["recompute_ttft_s"]) == len(cost["tiers"][0]["ttft_s"]) == n

        for _ in range(2):
            assert client.post("/v1/completions", json=completion(LONG)).status_code == 200

        def counted():
            data = client.get("/dashboard/data").json()
            rate = data["series"]["hit_rate"]["device pool"][-1]
            return data["now"]["requests_finished"] == 2 and rate is not None and rate > 0

        assert wait_for(counted, timeout=5)  # the second request hit the first's blocks
        series = client.get("/dashboard/data").json()["series"]
        assert len(series["t"]) >= 2 and series["t"][-1] == 0.0 and series["t"][0] < 0
        assert series["hit_rate"]["host"][-1] == 0.0  # looked up, none loaded


def test_two_tenants_show_with_tokens_per_second_and_ttft_percentiles():
    keys = {"key-alice": "alice", "key-bob": "bob"}
    with serve(fake_engine(), api_keys=keys, admin_key=ADMIN) as (server, client):
        server.app.state.dashboard.history.interval_s = 0.05
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for key, num_requests in (("key-alice", 2), ("key-bob", 1)):
            for _ in range(num_requests):
                r = client.post(
                    "/v1/completions",
                    json=completion(LONG, max_tokens=5),
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5

        def shown():
            now = client.get("/dashboard/data", headers=admin).json()["now"]
            return now["requests_finished"] == 3 and now["ttft_p99_s"] is not None

        assert wait_for(shown, timeout=5)
        data = client.get("/dashboard/data", headers=admin).json()
        now, series = data["now"], data["series"]
        assert now["generated_tokens"] == 15 and now["tokens_per_s"] > 0
        assert 0 < now["ttft_p50_s"] <= now["ttft_p99_s"]
        assert max(v for v in series["tokens_per_s"] if v is not None) > 0
        assert len(series["ttft_p50_s"]) == len(series["ttft_p99_s"]) == len(series["t"])
        rows = {row["name"]: row for row in data["tenants"]}
        assert [row["name"] for row in data["tenants"]] == ["alice", "bob"]
        assert (rows["alice"]["requests"], rows["bob"]["requests"]) == (2, 1)
        assert rows["alice"]["generated_tokens"] == 10 and rows["bob"]["generated_tokens"] == 5
        assert rows["alice"]["prompt_tokens"] == 2 * rows["bob"]["prompt_tokens"] > 0
        assert rows["alice"]["cached_tokens"] > 0  # her second request hit her first's blocks
        assert rows["bob"]["cached_tokens"] == 0  # never another tenant's
        metrics = client.get("/metrics").text
        # /metrics needs no key: no tenant's name or usage is in it (the admin's page only)
        assert "alice" not in metrics and "kvwise_tenant" not in metrics


def test_dashboard_without_tiers_has_no_cost_model():
    with serve(fake_engine()) as (_, client):
        data = client.get("/dashboard/data").json()
        assert data["cost_model"] is None and list(data["series"]["hit_rate"]) == ["device pool"]
        assert data["tiers"] == []


def test_429s_reach_the_dashboard():
    with serve(fake_engine()) as (server, client):
        server.app.state.metrics.requests.labels("/v1/completions", "429").inc(3)
        assert client.get("/dashboard/data").json()["now"]["rejected_429"] == 3


def test_admin_key_gates_the_dashboard():
    with serve(fake_engine(), api_keys=KEYS, admin_key=ADMIN) as (_, client):
        for path in ("/dashboard", "/dashboard/data", "/dashboard/dashboard.js"):
            r = client.get(path)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_admin_key"
            assert "admin key" in r.json()["error"]["message"]
            assert r.headers["www-authenticate"] == "Bearer"
        wrong = client.get("/dashboard/data", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "invalid admin key" in wrong.json()["error"]["message"]
        assert client.get("/dashboard/data?key=nope").status_code == 401
        tenant = client.get("/dashboard/data", headers={"Authorization": "Bearer key-alice"})
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "not_admin"
        assert client.get("/dashboard?key=key-alice").status_code == 403
        ok = client.get("/dashboard/data", headers={"Authorization": f"Bearer {ADMIN}"})
        assert ok.status_code == 200 and ok.json()["model"] == "fake"
        assert client.get(f"/dashboard/data?key={ADMIN}").status_code == 200
        # the admin key is no tenant key: /v1 refuses it
        assert (
            client.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code
            == 401
        )
        # /metrics and /health stay open
        assert client.get("/metrics").status_code == 200


def test_the_key_in_the_address_becomes_a_cookie():
    with serve(fake_engine(), api_keys=KEYS, admin_key=ADMIN) as (server, _):
        with httpx.Client(base_url=server.base_url, timeout=10) as browser:
            r = browser.get(f"/dashboard?key={ADMIN}&theme=x", follow_redirects=False)
            assert r.status_code == 303 and r.headers["location"] == "/dashboard"
            set_cookie = r.headers["set-cookie"]
            assert set_cookie.startswith(f"{COOKIE}=") and ADMIN not in set_cookie
            assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie
            assert "Path=/dashboard" in set_cookie
            assert browser.get("/dashboard").status_code == 200  # the cookie, no key
            assert browser.get("/dashboard/data").status_code == 200
            assert browser.get("/dashboard/dashboard.js").status_code == 200
        stale = httpx.get(server.base_url + "/dashboard/data", cookies={COOKIE: "0" * 64})
        assert stale.status_code == 401 and "stale" in stale.json()["error"]["message"]


def test_keys_without_an_admin_key_turn_the_dashboard_off():
    with serve(fake_engine(), api_keys=KEYS) as (_, client):
        r = client.get("/dashboard", headers={"Authorization": "Bearer key-alice"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "dashboard_disabled"
        assert "--admin-key" in r.json()["error"]["message"]


def test_an_admin_key_alone_gates_the_dashboard():
    with serve(fake_engine(), admin_key=ADMIN) as (_, client):
        assert client.get("/dashboard/data").status_code == 401
        assert client.get(f"/dashboard/data?key={ADMIN}").status_code == 200
        assert client.post("/v1/completions", json=completion("hi")).status_code == 200


@pytest.mark.parametrize("bad", ["", "  ", " padded", "key-alice"])
def test_bad_admin_keys_are_refused_without_echo(bad):
    with pytest.raises(ValueError, match="^admin_key: ") as info:
        create_app(fake_engine(), api_keys=KEYS, admin_key=bad)
    assert "key-alice" not in str(info.value)


def test_serve_refuses_a_bad_admin_key_before_loading_the_model(monkeypatch, capsys):
    from kvwise.cli import main
    from kvwise.engine import builder

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the admin key was checked")

    monkeypatch.setattr(builder, "build_engine", no_model)
    monkeypatch.delenv("KVWISE_ADMIN_KEY", raising=False)
    monkeypatch.delenv("KVWISE_API_KEYS", raising=False)
    assert main(["serve", "--api-key", "key-alice=alice", "--admin-key", "key-alice"]) == 2
    err = capsys.readouterr().err
    assert "--admin-key: must differ from every tenant's API key" in err
    assert err.count("key-alice") == 0


def test_the_gate_takes_the_key_out_of_the_logged_query_string():
    seen = {}

    async def app(scope, receive, send):
        seen["query"] = scope["query_string"]

    gate = AdminGate(app, ADMIN, [])
    scope = {"type": "http", "path": "/dashboard/data", "method": "GET", "headers": [],
             "query_string": f"a=1&key={ADMIN}".encode()}  # fmt: skip
    asyncio.run(gate(scope, None, None))
    assert seen["query"] == b"a=1" and scope["query_string"] == b"a=1"
    # other paths are not touched
    scope = {"type": "http", "path": "/v1/models", "query_string": b"key=x", "headers": []}
    asyncio.run(gate(scope, None, None))
    assert scope["query_string"] == b"key=x"


def test_serve_takes_the_admin_key_from_a_flag_or_the_environment(monkeypatch):
    from kvwise.cli import build_parser

    monkeypatch.delenv("KVWISE_ADMIN_KEY", raising=False)
    assert build_parser().parse_args(["serve"]).admin_key is None
    assert build_parser().parse_args(["serve", "--admin-key", "k1"]).admin_key == "k1"
    monkeypatch.setenv("KVWISE_ADMIN_KEY", "k2")
    assert build_parser().parse_args(["serve"]).admin_key == "k2"
    monkeypatch.setenv("KVWISE_ADMIN_KEY", "")
    assert build_parser().parse_args(["serve"]).admin_key is None


def test_bench_load_url_drives_a_running_server(capsys):
    from kvwise.bench import load
    from kvwise.cli import build_parser

    # the load's system prompt is ~2,600 bytes: byte tokens on the fake engine
    engine = fake_engine(num_blocks=4096, max_model_len=8192)
    with serve(engine, api_keys=KEYS, admin_key=ADMIN) as (server, client):
        argv = ["bench", "load", "--url", server.base_url, "--api-key", "key-alice"]
        argv += ["--clients", "2", "--duration", "1", "--max-tokens", "4"]
        assert load.main(build_parser().parse_args(argv)) == 0
        out, err = capsys.readouterr()
        row = next(r for r in out.splitlines() if server.base_url in r)
        # progress on stderr: the load's bar with its counts; stdout keeps only the table
        assert f"load {server.base_url}: 100%" in err and "ok=" in err and "tokens=" in err
        assert all(line.startswith("|") for line in out.splitlines() if line)
        num_ok, num_429, errors = (c.strip() for c in row.split("|")[2:5])
        assert int(num_ok) > 0 and (num_429, errors) == ("0", "0")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert client.get("/dashboard/data", headers=admin).json()["now"]["requests_finished"] > 0
        for bad, message in (("localhost:1", "expected http"), (server.base_url, "answered 401")):
            argv = ["bench", "load", "--url", bad, "--duration", "1"]
            with pytest.raises(ValueError, match=f"^url: .*{message}"):
                load.main(build_parser().parse_args(argv))

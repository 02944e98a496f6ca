"""The dashboard in headless Chromium against a live ``kvwise serve`` (the default model, a
disk tier in a temporary directory, API keys of two tenants and an admin key): the page loads
with no console error, every chart is drawn, a chat request sent meanwhile shows in the
counters and the hit-rate chart within seconds, and requests of both tenants then show as
tokens/s, TTFT p50 / p99 (tiles and chart) and a row per tenant. The admin key gates it
(401 / 403) and never reaches the server's log."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import stop_serving, wait_until_serving
from tests.server.test_cli_serve import _free_port

ADMIN = "admin-3f9c2e71"
TENANT_KEY = "sk-browser"
OTHER_TENANT_KEY = "sk-browser-2"
CHARTS = ("pool", "hits", "cost", "decisions", "queue")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``kvwise serve`` in a subprocess; yields its base URL and, at the end, checks its log."""
    port = _free_port()
    disk = tmp_path_factory.mktemp("kv-disk")
    cmd = [sys.executable, "-m", "kvwise.cli", "serve", "--port", str(port)]
    cmd += ["--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--kv-disk-path", str(disk)]
    cmd += ["--api-key", f"{TENANT_KEY}=carol", "--api-key", f"{OTHER_TENANT_KEY}=dave"]
    cmd += ["--admin-key", ADMIN]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    yield base
    log = stop_serving(proc, timeout=30)
    assert "GET /dashboard" in log  # the access log is on ...
    assert ADMIN not in log  # ... and the key in ?key= never reached it
    # the start-up self-test of each tier: sealed, written, read back, opened
    assert re.search(r"KV tier self-test: host ok \([\d.]+ ms\), disk ok \([\d.]+ ms\)", log)


def poll(page, expression: str, expected=True, timeout_s: float = 10.0) -> bool:
    """Whether ``expression`` evaluates to ``expected`` in the page within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if page.evaluate(expression) == expected:
            return True
        time.sleep(0.1)
    return page.evaluate(expression) == expected


def test_admin_key_gates_the_live_dashboard(server):
    r = httpx.get(server + "/dashboard/data")
    assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
    r = httpx.get(server + "/dashboard", headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_admin"
    r = httpx.get(server + "/dashboard/data", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["engine_up"] is True
    assert {t["name"] for t in r.json()["cost_model"]["tiers"]} >= {"disk"}


def test_dashboard_draws_and_counts_a_request(server, browser):
    from openai import OpenAI

    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server}/dashboard?key={ADMIN}")
    assert page.url == f"{server}/dashboard"  # the key left the address bar for a cookie
    # NOTE: polled from here: Playwright's wait_for_function evaluates strings, which the
    # page's Content-Security-Policy (no eval) refuses
    assert poll(page, "Number(document.body.dataset.updates || 0) >= 1")

    def drawn(chart: str) -> int:
        """Series paths with something drawn in the chart's SVG."""
        return page.evaluate(
            """id => [...document.querySelectorAll(`#chart-${id} path.series`)]
                       .filter(p => (p.getAttribute('d') || '').length > 10).length""",
            chart,
        )

    for chart in ("pool", "cost", "decisions", "queue"):
        assert drawn(chart) > 0, chart
    assert drawn("cost") >= 3  # recompute, host and disk
    assert page.locator("#chart-cost .marker").count() >= 1  # a break-even is marked
    assert page.inner_text("#tile-requests_finished .value") == "0"

    client = OpenAI(base_url=f"{server}/v1", api_key=TENANT_KEY, max_retries=0, timeout=60)
    start = time.monotonic()
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Name three planets."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.usage.completion_tokens > 0
    assert poll(page, "document.querySelector('#tile-requests_finished .value').textContent", "1")
    assert poll(page, "document.querySelectorAll('#chart-hits path.series').length > 0")
    assert time.monotonic() - start < 15
    assert drawn("hits") > 0 or page.locator("#chart-hits circle.point").count() > 0
    assert page.inner_text("#tile-ttft .value") not in ("", "–")
    assert page.locator("#banner").is_hidden()

    # a second tenant, and more of the first: tokens/s, TTFT percentiles and a row each
    dave = OpenAI(base_url=f"{server}/v1", api_key=OTHER_TENANT_KEY, max_retries=0, timeout=60)
    for c, question in ((dave, "Name a colour."), (client, "Name a fruit."), (dave, "Hi!")):
        reply = c.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": question}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.usage.completion_tokens > 0
    tile = "document.querySelector('#tile-{} .value').textContent"
    assert poll(page, tile.format("requests_finished"), "4")
    assert poll(page, "document.querySelectorAll('#tenants-body tr').length", 2)
    rows = page.evaluate(
        """[...document.querySelectorAll('#tenants-body tr')]
             .map(r => [...r.cells].map(c => c.textContent))"""
    )
    assert [(r[0], r[1]) for r in rows] == [("carol", "2"), ("dave", "2")], rows
    assert all(int(r[2]) > 0 and int(r[3]) > 0 for r in rows), rows  # prompt, generated tokens
    tokens_per_s = page.inner_text("#tile-tokens_per_s .value")
    assert tokens_per_s not in ("", "–") and float(tokens_per_s) > 0
    p50, p99 = (page.inner_text(f"#tile-ttft_{p} .value") for p in ("p50", "p99"))
    assert p50.endswith(("ms", " s")) and p99.endswith(("ms", " s")), (p50, p99)
    assert drawn("tokens") > 0 or page.locator("#chart-tokens circle.point").count() > 0
    assert drawn("ttft") >= 2  # p50 and p99
    assert errors == []
    page.close()

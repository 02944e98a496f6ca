"""A failing KV tier on the dashboard, in headless Chromium: the real server on the default
model with a disk tier whose every read raises. The page says so above the tiles (the tier,
its open breaker, the error) and its tier row shows the errors and "breaker open"; before the
failure it shows neither."""

from __future__ import annotations

import errno
import time

import httpx
import pytest

from kvwise.server import create_app
from kvwise.store import disk_files
from tests.browser.test_dashboard_browser import poll
from tests.server.conftest import LiveServer
from tests.tiers_util import PROMPT, evict_device

pytestmark = pytest.mark.slow

BODY = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}


def test_a_failing_tier_shows_on_the_dashboard(tier_engine, tmp_path, monkeypatch, browser):
    engine = tier_engine(kv_disk_path=str(tmp_path), kv_load_policy="always")
    with (
        LiveServer(create_app(engine, model_name="m")) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as client,
    ):
        assert client.post("/v1/completions", json=BODY).status_code == 200
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server.base_url}/dashboard")
        row = "document.querySelector('#tier-disk')"
        assert poll(page, f"{row} !== null && {row}.cells[8].textContent", "ok")
        assert (
            page.evaluate("getComputedStyle(document.querySelector('#tier-alert')).display")
            == "none"
        )

        def eio(fd, buffers):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(disk_files, "_preadv_all", eio)
        for _ in range(3):  # 3 chunks a prompt: the breaker opens in the second load
            server.engine.call_sync(evict_device)
            assert client.post("/v1/completions", json=BODY).status_code == 200
        time.sleep(0.1)
        assert poll(page, f"{row}.cells[8].textContent", "breaker open", timeout_s=15)
        assert int(page.evaluate(f"{row}.cells[7].textContent")) >= 5  # the errors
        alert = page.evaluate("document.querySelector('#tier-alert').textContent")
        assert alert.startswith("KV tier disk degraded: breaker open") and "read EIO" in alert
        assert (
            page.evaluate("getComputedStyle(document.querySelector('#tier-alert')).display")
            == "block"
        )
        assert "read EIO" in page.evaluate(f"{row}.cells[8].title")
        page.screenshot(path=str(tmp_path / "dashboard_tier_failure.png"), full_page=True)
        assert errors == []
        page.close()

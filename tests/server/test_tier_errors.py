"""A disk tier whose every read raises, behind the real server on the default model: the
answers are unchanged (the prefix is recomputed), and the failure is loud: the error counter
in /metrics, one log line with its traceback, the open breaker, and /health's reason."""

from __future__ import annotations

import errno
import logging
import re

import httpx
import pytest

from kvwise.server import create_app
from kvwise.store import disk_files
from tests.server.conftest import LiveServer
from tests.tiers_util import PROMPT, evict_device

pytestmark = pytest.mark.slow

BODY = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in /metrics")


def test_every_disk_read_failing_is_seen_and_answers_are_unchanged(
    tier_engine, tmp_path, monkeypatch, caplog
):
    engine = tier_engine(kv_disk_path=str(tmp_path), kv_load_policy="always")
    caplog.set_level(logging.WARNING, "kvwise.store")
    with (
        LiveServer(create_app(engine, model_name="m")) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as client,
    ):

        def answer() -> str:
            response = client.post("/v1/completions", json=BODY)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        def read_errors() -> float:
            text = client.get("/metrics").text
            return _metric(text, "kvwise_tier_errors_total", tier="disk", op="read")

        reference = answer()
        server.engine.call_sync(evict_device)
        assert answer() == reference  # the control: loaded from the disk tier
        assert server.engine.stats().store.tiers["disk"].loaded_tokens > 0
        assert client.get("/health").json() == {"status": "ok"}
        assert read_errors() == 0

        def eio(fd, buffers):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(disk_files, "_preadv_all", eio)
        counts = []
        for _ in range(4):
            server.engine.call_sync(evict_device)
            assert answer() == reference  # every failed load is recomputed
            counts.append(read_errors())
        # the breaker opened after 5 consecutive read errors (3 chunks a prompt): the last
        # requests did not touch the tier
        assert counts[1] >= 5 and counts[-1] == counts[1]
        metrics = client.get("/metrics").text
        assert _metric(metrics, "kvwise_tier_breaker_open", tier="disk") == 1
        health = client.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "degraded"
        assert re.search(r"breaker open .*read EIO", body["degraded_tiers"]["disk"])
    logged = [r for r in caplog.records if "read error: read EIO" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # once, with its traceback
    opened = [r for r in caplog.records if "breaker open after 5" in r.getMessage()]
    assert len(opened) == 1

"""The long benchmarks' progress on stderr (``kvwise/bench/progress.py``): a line per phase
with its seconds, bars over counts and over a timed load's seconds, and the server start-up
that ``serve_process`` (every ``bench load | chat | agents`` server) reports. Stdout stays
clean for tables and JSON. ``bench load``'s bar in a whole run: tests/server/test_dashboard.py."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kvwise.bench.common import serve_process
from kvwise.bench.llamacpp import free_port
from kvwise.bench.progress import TimedBar, bar, phase


def test_a_phase_says_when_it_starts_and_how_long_it_took(capsys):
    with phase("warm-up"):
        pass
    with pytest.raises(RuntimeError), phase("loading"):
        raise RuntimeError("no")
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == "warm-up ..." and lines[1].startswith("warm-up: done in ")
    assert lines[2] == "loading ..." and lines[3].startswith("loading: failed after ")


def test_bars_count_turns_and_the_seconds_of_a_timed_load(capsys):
    with bar(3, "chat kvwise", "turn") as progress:
        for _ in range(3):
            progress.update()
    counts = {"ok": 0}

    async def load():
        timed = TimedBar(0.6, "load kvwise", lambda: dict(counts))
        ticker = asyncio.create_task(timed.run())
        for _ in range(3):
            await asyncio.sleep(0.25)
            counts["ok"] += 1
        ticker.cancel()
        timed.close()

    asyncio.run(load())
    out, err = capsys.readouterr()
    assert out == ""
    assert "chat kvwise: 100%" in err and "3/3" in err
    assert "load kvwise: 100%" in err and "ok=3" in err


def test_serve_process_reports_the_server_start_up(tmp_path, capsys):
    """A real server process (Python's http.server, whose /health is a file) through
    ``serve_process``: its start-up is a phase on stderr, the work's result comes back."""
    (tmp_path / "health").write_text("ok")
    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    cmd += ["--directory", str(tmp_path)]
    url = f"http://127.0.0.1:{port}"

    async def work(u):
        return {"url": u}

    assert serve_process(cmd, url, work, timeout=60, name="test server") == {"url": url}
    out, err = capsys.readouterr()
    assert out == ""
    assert f"starting test server on {url} ..." in err
    assert f"starting test server on {url}: done in " in err

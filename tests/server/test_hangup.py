"""A hang-up cancels all of a request's work (issue 45, item 4): every choice of every prompt,
admitted or not yet admitted, streamed or not, is aborted once the client goes away, the
request is counted in ``kvwise_requests_cancelled_total``, and a request asking for more
sequences (n x prompts) than ``max_sequences_per_request`` is a 400 naming the field.

The tiny model is slowed to 80 ms a step: the server admits one sequence a step, so 32
sequences take about 2.6 s to admit, and a disconnect at 0.5 s is caught mid-admission."""

from __future__ import annotations

import re

import httpx
import pytest

from kvwise.engine.async_engine import AsyncEngine
from kvwise.server import create_app
from tests.fakes import ControlledRunner

from .conftest import TINY_NAME, LiveServer, wait_for

CAP = 32
PROMPTS = [f"tell me story number {i} " * 4 for i in range(8)]
MANY = {"prompt": PROMPTS, "n": 4, "max_tokens": 200, "ignore_eos": True}  # 32 sequences
CHAT = {
    "messages": [{"role": "user", "content": "tell me a story"}],
    "n": 16,
    "max_tokens": 200,
    "ignore_eos": True,
}
FREED_WITHIN_S = 1.0  # the step is 80 ms: the rest of an admission would take seconds


@pytest.fixture(scope="module")
def hangup_server(make_tiny_engine):
    engine = make_tiny_engine(max_num_seqs=CAP, max_waiting=64, wrap_runner=ControlledRunner)
    engine.runner.delay_s = 0.08
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, model_name=TINY_NAME, max_sequences_per_request=CAP)
    with LiveServer(app) as server:
        yield server
    async_engine.shutdown()


def used_blocks(server) -> int:
    return server.engine.call_sync(lambda e: e.kv_manager.pool.num_used_blocks)


def idle(server) -> bool:
    stats = server.engine.call_sync(lambda e: e.stats())
    return stats.num_running == 0 and stats.num_waiting == 0 and used_blocks(server) == 0


def cancelled(server) -> tuple[float, float]:
    """kvwise_requests_cancelled_total and kvwise_sequences_cancelled_total, now."""
    text = httpx.get(server.base_url + "/metrics").text
    values = []
    for name in ("kvwise_requests_cancelled_total", "kvwise_sequences_cancelled_total"):
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        assert found, f"{name} not in /metrics"
        values.append(float(found.group(1)))
    return values[0], values[1]


def assert_cancelled_all(server, before: tuple[float, float]) -> None:
    assert wait_for(lambda: idle(server), timeout=FREED_WITHIN_S), (
        "sequences of a hung-up request still in the engine"
    )
    server.engine.call_sync(lambda e: e.check_integrity())
    requests, sequences = cancelled(server)
    assert requests == before[0] + 1
    assert sequences > before[1]


def hang_up_during_admission(server, path: str, body: dict) -> None:
    """Send ``body``, and go away once the engine runs some of it (mid-admission)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + path, json=body, timeout=httpx.Timeout(30, read=0.5))
    assert server.engine.stats().num_running < CAP  # still admitting when the client left


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_hang_up_during_admission_cancels_every_prompt_and_choice(hangup_server, stream):
    assert wait_for(lambda: idle(hangup_server), timeout=10)
    before = cancelled(hangup_server)
    hang_up_during_admission(hangup_server, "/v1/completions", {**MANY, "stream": stream})
    assert_cancelled_all(hangup_server, before)


def test_chat_hang_up_during_admission_cancels_every_choice(hangup_server):
    assert wait_for(lambda: idle(hangup_server), timeout=10)
    before = cancelled(hangup_server)
    hang_up_during_admission(hangup_server, "/v1/chat/completions", {**CHAT, "stream": True})
    assert_cancelled_all(hangup_server, before)


def test_hang_up_after_the_first_tokens_cancels_every_sequence(hangup_server):
    assert wait_for(lambda: idle(hangup_server), timeout=10)
    before = cancelled(hangup_server)
    with httpx.Client(base_url=hangup_server.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**MANY, "stream": True}) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
            assert hangup_server.engine.stats().num_running > 0
    assert_cancelled_all(hangup_server, before)


def test_a_whole_answer_is_not_counted_as_cancelled(hangup_server):
    assert wait_for(lambda: idle(hangup_server), timeout=10)
    before = cancelled(hangup_server)
    body = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 2}
    for stream in (False, True):
        r = httpx.post(hangup_server.base_url + "/v1/completions", json={**body, "stream": stream})
        assert r.status_code == 200
    assert cancelled(hangup_server) == before


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**MANY, "n": 5}, "n"),
        ("/v1/completions", {"prompt": PROMPTS * 5, "max_tokens": 1}, "prompt"),
    ],
)
def test_more_sequences_than_the_cap_is_a_400_naming_the_field(hangup_server, path, body, param):
    r = httpx.post(hangup_server.base_url + path, json={**body, "stream": False})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert f"limit of {CAP} per request" in error["message"]
    assert error["message"].startswith(f"{param}: ")
    assert idle(hangup_server)


def test_the_cap_must_be_at_least_one(make_tiny_engine):
    with pytest.raises(ValueError, match="max_sequences_per_request"):
        create_app(make_tiny_engine(), max_sequences_per_request=0)


def test_the_serve_flag(capsys):
    from kvwise.cli import build_parser
    from kvwise.server.routes import DEFAULT_MAX_SEQUENCES_PER_REQUEST

    args = build_parser().parse_args(["serve"])
    assert args.max_sequences_per_request == DEFAULT_MAX_SEQUENCES_PER_REQUEST == 64
    args = build_parser().parse_args(["serve", "--max-sequences-per-request", "1024"])
    assert args.max_sequences_per_request == 1024
    for bad in ("0", "-3", "1.5", "many"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", "--max-sequences-per-request", bad])
        assert info.value.code == 2
        assert "--max-sequences-per-request" in capsys.readouterr().err

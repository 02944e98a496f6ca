"""No head-of-line blocking (issue 45, item 3), end to end on the default model: with a small
KV pool, alice's two long decodes running and her prompt that needs most of the pool waiting
for them to finish, bob's short request is admitted past it. His TTFT stays within 2x his
TTFT with only the decodes running (measured in the same test); before, admission was strict
FIFO and bob waited behind alice's big prompt until every decode had finished (seconds).
/metrics says how many admissions went past a waiting request."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from kvwise.server import create_app
from tests.server.test_openai_client import MODEL

from .conftest import KEYS, LiveServer, wait_for

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NUM_BLOCKS = 80  # 1,280 tokens: both decodes whole, or alice's big prompt, never all three
DECODE_PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 30  # ~360 tokens:
# each decode's own (no shared prefix): 23 blocks, 31 when done
BIG_PROMPT = "Summarise the following notes on ships and harbours. " * 70  # ~700 tokens
BOB_BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}


def _alice_decode(base: str, i: int, started: threading.Event, errors: list) -> None:
    body = {"model": MODEL, "prompt": f"{i}. {DECODE_PROMPT}", "max_tokens": 120, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": "Bearer key-alice"}
    try:
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers=headers, timeout=120
        ) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    started.set()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
        started.set()


def _bob_ttft_s(client: httpx.Client) -> float:
    """Bob's latency for one token: his time to first token."""
    start = time.perf_counter()
    response = client.post("/v1/completions", json=BOB_BODY)
    assert response.status_code == 200, response.text
    return time.perf_counter() - start


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


@pytest.fixture
def small_pool_server(make_engine):
    # 720 KiB a block of 16 tokens (30 layers x 3 KV heads x 64 x K and V, float32)
    engine = make_engine(max_model_len=2048, block_size=BLOCK_SIZE, kv_cache_memory="57600KiB")
    assert engine.kv_manager.num_blocks == NUM_BLOCKS
    app = create_app(engine, api_keys=KEYS, model_name=MODEL)
    with LiveServer(app) as server:
        yield server


def test_a_big_waiting_prompt_does_not_hold_up_another_tenant(small_pool_server):
    base = small_pool_server.base_url
    started = [threading.Event(), threading.Event()]
    errors: list = []
    decodes = [
        threading.Thread(target=_alice_decode, args=(base, i, event, errors))
        for i, event in enumerate(started)
    ]
    for thread in decodes:
        thread.start()
    assert all(event.wait(60) for event in started) and not errors, errors
    bob = httpx.Client(base_url=base, timeout=120, headers={"Authorization": "Bearer key-bob"})
    _bob_ttft_s(bob)  # warm-up
    baseline_s = statistics.median(_bob_ttft_s(bob) for _ in range(5))

    big: dict = {}
    body = {"model": MODEL, "prompt": BIG_PROMPT, "max_tokens": 2, "temperature": 0}
    alice = threading.Thread(
        target=lambda: big.setdefault("response", httpx.post(
            f"{base}/v1/completions", json=body, timeout=120,
            headers={"Authorization": "Bearer key-alice"})),
    )  # fmt: skip
    alice.start()
    waiting = wait_for(lambda: _metric(base, "kvwise_requests_waiting") == 1, timeout=30)
    assert waiting, httpx.get(f"{base}/metrics").text  # alice's big prompt waits for blocks
    still_decoding = all(thread.is_alive() for thread in decodes)
    waited = []  # bob's TTFTs while alice's prompt waits
    while len(waited) < 5:
        waited.append(_bob_ttft_s(bob))
        if _metric(base, "kvwise_requests_waiting") == 0:
            break  # admitted (strict FIFO: bob's first request waited for it)
    waited_s = statistics.median(waited)
    print(f"bob's TTFT: {baseline_s * 1e3:.0f} ms, {waited_s * 1e3:.0f} ms behind the big prompt")
    bob.close()

    alice.join(120)
    for thread in decodes:
        thread.join(120)
    assert still_decoding, "the decodes ended before bob was measured: lengthen them"
    assert waited_s <= 2 * baseline_s, (
        f"bob's TTFT {waited_s * 1e3:.0f} ms behind alice's waiting prompt, "
        f"{baseline_s * 1e3:.0f} ms without it"
    )
    assert big["response"].status_code == 200, big["response"].text  # not starved
    assert not errors, errors
    assert _metric(base, "kvwise_admission_skips_total") >= 5
    assert _metric(base, "kvwise_requests_waiting") == 0
    assert _metric(base, "kvwise_oldest_waiting_seconds") == 0

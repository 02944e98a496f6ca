"""Nobody stalls anybody, measured: ``kvwise bench load``'s clients (tenant alice) against a
``kvwise serve`` on loopback, clean and hostile, interleaved.

- clean: the server's Redis tier is a real ``redis-server`` on a loopback port, emptied
  before each run (every run starts as cold as the hostile one); nobody else.
- hostile: the Redis tier points at a misbehaving server (``--redis-mode``: ``slow`` answers
  one byte every 50 ms, ``silent`` accepts and never answers, ``garbage`` answers the
  handshake with bytes that are no Redis reply), and tenant mallory floods the server with
  bad and huge requests the whole time (230,000 tiny messages, a 5M-character prompt, a
  million token ids, 2,048 messages that render past the context, a 4 MB prompt_cache_key,
  broken JSON), ``--flooders`` at a time.
- grammar: the real Redis, and mallory sends structured-output requests whose schema is new
  each time and would take llguidance minutes to compile (``patternProperties`` of 450
  patterns), hanging up after 1 s on every other one.
- huge-n: the real Redis, and mallory sends bodies over the server's cap of 64 sequences a
  request: 64 prompts x n = 16, n = 128, 65 prompts.
- hangup: the real Redis, and mallory sends 4 prompts x n = 16 of 1,024 tokens each (64
  sequences, within the cap) and hangs up on each after 1 s: not an attack but a tenant
  using the batch a second at a time (no per-tenant share of the batch is enforced).

Reported per run: alice's requests ok / errors, TTFT p50 / p99, tokens/s; mallory's answers by
status (every one must be a 4xx, or her own hang-up); the pool afterwards (no leaked blocks);
and the medians' ratio of each attack to clean. A benchmark, not a test: run it by hand, e.g.

    .venv/bin/python scripts/bench_isolation.py --rounds 5 --duration 30 --clients 32

Every server it starts listens on 127.0.0.1 and keeps its disk tier in a temporary directory;
every loop is bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from kvwise.bench.common import wait_ready
from kvwise.bench.load import _kvwise_after, _load

SECRET = secrets.token_hex(32)  # a store secret for the benchmark's servers only
KEYS = {"key-alice": "alice", "key-mallory": "mallory"}
MODEL = "SmolLM2-135M-Instruct"
KINDS = ("clean", "hostile", "grammar", "huge-n", "hangup")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BadRedis(threading.Thread):
    """A TCP server on 127.0.0.1 that speaks Redis badly (see the module's docstring)."""

    def __init__(self, mode: str) -> None:
        super().__init__(daemon=True)
        self.mode = mode
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.stopped = threading.Event()
        self.connections = 0

    def run(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        deadline = time.monotonic() + 120  # no connection lives longer than this
        try:
            while not self.stopped.is_set() and time.monotonic() < deadline:
                try:
                    if not conn.recv(65536):
                        return
                except TimeoutError:
                    continue
                if self.mode == "silent":
                    continue
                if self.mode == "garbage":
                    conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n\x00\xff not redis\r\n")
                    continue
                for byte in b"+OK\r\n":  # slow: one byte at a time
                    if self.stopped.wait(0.05):
                        return
                    conn.sendall(bytes([byte]))
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopped.set()
        self.sock.close()


@functools.cache
def flood_bodies() -> list[tuple[str, bytes]]:
    """(path, body) of each kind of bad or huge request mallory sends."""
    tiny = [{"role": "user", "content": ""}]

    def chat(**fields) -> bytes:
        return json.dumps({"model": MODEL, "max_tokens": 8, **fields}).encode()

    return [
        ("/v1/chat/completions", chat(messages=tiny * 230_000)),
        ("/v1/completions", chat(prompt="x" * 5_000_000)),
        ("/v1/completions", chat(prompt=[1] * 1_000_000)),
        ("/v1/chat/completions", chat(messages=tiny * 2048)),
        ("/v1/chat/completions", chat(messages=tiny, prompt_cache_key="k" * 4_000_000)),
        (
            "/v1/chat/completions",
            b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "cont',
        ),
    ]


def slow_schema(tag: str, n: int = 450) -> dict:
    """A schema llguidance takes minutes to compile (cubic in ``n``); ``tag`` makes it new."""
    patterns = {f"^{tag}[a-z]{{{i}}}$": {"type": "integer"} for i in range(1, n + 1)}
    return {"type": "object", "patternProperties": patterns}


def attack_request(mode: str, n: int) -> tuple[str, bytes, float]:
    """Mallory's ``n``-th request of an attack: (path, body, seconds she waits for it)."""
    if mode == "hostile":
        bodies = flood_bodies()
        path, body = bodies[n % len(bodies)]
        return path, body, 60.0
    if mode == "grammar":  # a new slow schema each time; every other one hung up after 1 s
        fields = {
            "messages": [{"role": "user", "content": "Fill it in."}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": slow_schema(f"m{n}x")},
            },
        }
        body = json.dumps({"model": MODEL, "max_tokens": 8, **fields}).encode()
        return "/v1/chat/completions", body, 1.0 if n % 2 == 0 else 60.0
    if mode == "huge-n":  # bodies over the server's 64 sequences a request: each a 400
        shapes = (
            {"prompt": [f"Story {n}-{i}." for i in range(64)], "n": 16},
            {"prompt": "Tell me a story.", "n": 128},
            {"prompt": [f"Story {n}-{i}." for i in range(65)], "n": 1},
        )
        body = {"model": MODEL, "max_tokens": 1024, "ignore_eos": True, **shapes[n % 3]}
        return "/v1/completions", json.dumps(body).encode(), 60.0
    # hangup: 4 prompts x n = 16 (64 sequences, within the cap) of 1,024 tokens each, hung up
    # after 1 s: a tenant using its share of the batch for a second at a time, not an attack
    prompts = [f"Tell me story number {n}-{i}." for i in range(4)]
    body = {"model": MODEL, "prompt": prompts, "n": 16, "max_tokens": 1024, "ignore_eos": True}
    return "/v1/completions", json.dumps(body).encode(), 1.0


async def flood(url: str, deadline: float, num_flooders: int, mode: str) -> dict:
    """Mallory's requests until ``deadline``: the count of answers by status."""
    counts: dict[str, int] = {}
    headers = {"Authorization": "Bearer key-mallory", "Content-Type": "application/json"}

    async def one(i: int, http: httpx.AsyncClient) -> None:
        n = i
        while time.perf_counter() < deadline and n < 100_000:
            path, body, wait_s = attack_request(mode, n)
            n += num_flooders
            try:
                r = await http.post(
                    url + path,
                    content=body,
                    headers=headers,
                    timeout=httpx.Timeout(60, read=wait_s),
                )
                key = str(r.status_code)
            except httpx.ReadTimeout:
                key = "hung up"
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            counts[key] = counts.get(key, 0) + 1

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(one(i, http) for i in range(num_flooders)))
    return counts


def _ready(nice: int, mode: str) -> None:
    """Load mallory's process (imports, her request bodies) before the runs start."""
    os.nice(nice)
    attack_request(mode, 0)
    if mode == "hostile":
        flood_bodies()


def _flood_process(url: str, duration: float, num_flooders: int, nice: int, mode: str) -> dict:
    return asyncio.run(flood(url, time.perf_counter() + duration, num_flooders, mode))


def run_once(kind: str, args, redis_url: str, tmp: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    disk = tempfile.mkdtemp(dir=tmp, prefix=f"disk-{kind}-")
    cmd = [
        sys.executable, "-m", "kvwise.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--kv-disk-path", disk, "--kv-redis-url", redis_url,
        "--max-waiting", str(args.max_waiting),
    ]  # fmt: skip
    for key, tenant in KEYS.items():
        cmd += ["--api-key", f"{key}={tenant}"]
    env = {**os.environ, "KVWISE_KV_SECRET": SECRET}
    log = open(tmp / f"serve-{kind}-{port}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
    try:
        wait_ready(url, proc, timeout=300, path="/health")
        load_args = argparse.Namespace(
            clients=args.clients,
            duration=args.duration,
            max_requests=5000,
            max_tokens=args.max_tokens,
            api_key="key-alice",
        )

        flooder = None
        if kind != "clean":  # her own process: not alice's clients' event loop
            flooder = multiprocessing.get_context("spawn").Pool(1)
            # NOTE: her process imports what it needs (~1 s of CPU) before alice's first wave:
            # started together, the import ran beside that wave and doubled its p99 in every
            # attack, a cost of sharing one machine with the attacker, not of her requests
            flooder.apply(_ready, (args.flooder_nice, kind))
            flooded_async = flooder.apply_async(
                _flood_process, (url, args.duration, args.flooders, args.flooder_nice, kind)
            )
        result = asyncio.run(_load(url, MODEL, load_args))
        flooded = {}
        if flooder is not None:
            flooded = flooded_async.get(args.duration + 120)
            flooder.close()
        result.update(_kvwise_after(url))
        result["flood"] = flooded
        return result
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(disk, ignore_errors=True)


def start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="clean + hostile pairs, interleaved")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=48)
    p.add_argument("--flooders", type=int, default=2, help="mallory's concurrent requests")
    p.add_argument(
        "--flooder-nice",
        type=int,
        default=19,
        help="niceness of mallory's client process: on one machine her client's CPU is the "
        "server's, which a client on another machine's would not be",
    )
    p.add_argument("--redis-mode", choices=("slow", "silent", "garbage"), default="slow")
    p.add_argument("--out", default=None, help="write every run as JSON here")
    p.add_argument(
        "--kinds",
        default="clean,hostile",
        help=f"which runs, of {','.join(KINDS)} (e.g. clean,grammar,huge-n)",
    )
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvwise-isolation-"))
    redis_proc, good_url = start_redis(tmp)
    bad = BadRedis(args.redis_mode)
    bad.start()
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        for i in range(args.rounds):
            for kind in kinds if i % 2 == 0 else kinds[::-1]:
                url = f"redis://127.0.0.1:{bad.port}/0" if kind == "hostile" else good_url
                if url == good_url:  # NOTE: cold, as the broken one is: no run starts warm
                    redis.Redis.from_url(good_url).flushall()
                r = run_once(kind, args, url, tmp)
                runs[kind].append(r)
                after = r["after"]
                print(
                    f"round {i + 1} {kind:7s}: ok {r['ok']:4d} errors {r['errors'] or 0} "
                    f"429 {r['429']:3d} | TTFT p50 {r['ttft_p50_s']:.3f} s p99 "
                    f"{r['ttft_p99_s']:.3f} s | {r['tokens_per_s']:6.1f} tok/s | blocks used "
                    f"after {after.get('kvwise_kv_blocks_used', float('nan')):.0f} | "
                    f"flood {r['flood']}\n    slowest TTFTs (s, sent at s): "
                    f"{r.get('slowest_ttft_s')}",
                    flush=True,
                )
    finally:
        bad.stop()
        redis_proc.terminate()
        redis_proc.wait(10)
    metrics = ("ttft_p50_s", "ttft_p99_s", "tokens_per_s")
    med = {k: {m: statistics.median(r[m] for r in v) for m in metrics} for k, v in runs.items()}
    print("\nmedians over", args.rounds, "rounds:")
    for kind, m in med.items():
        print(
            f"  {kind:7s}: TTFT p50 {m['ttft_p50_s']:.3f} s, p99 {m['ttft_p99_s']:.3f} s, "
            f"{m['tokens_per_s']:.1f} tok/s"
        )
    for kind in [k for k in med if k != "clean" and "clean" in med]:
        ratio = {m: med[kind][m] / med["clean"][m] for m in metrics}
        print(
            f"  {kind} / clean: TTFT p99 {ratio['ttft_p99_s']:.2f}x, "
            f"p50 {ratio['ttft_p50_s']:.2f}x, tokens/s {ratio['tokens_per_s']:.2f}x"
        )
    alice_errors = sum(sum(r["errors"].values()) for v in runs.values() for r in v)
    # NOTE: a connection the server closes on a 429 mid-upload is a ReadError for mallory:
    # what counts as a failure is a 5xx
    mallory_5xx = sum(
        n for v in runs.values() for r in v for s, n in r["flood"].items() if s.startswith("5")
    )
    leaked = max(r["after"].get("kvwise_kv_blocks_used", 0) for v in runs.values() for r in v)
    print(f"  alice's errors: {alice_errors}; mallory's 5xx answers: {mallory_5xx}; "
          f"most blocks used after a run: {leaked:.0f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "runs": runs, "medians": med}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

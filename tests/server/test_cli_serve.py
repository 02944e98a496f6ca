"""``kvwise serve``: key parsing, and the real command in a subprocess (default model): it
serves, reads keys from KVWISE_API_KEYS, answers an oversized header with a JSON 431, another
Host than a loopback name with a 421 and an unfinished head with a 408 at --header-timeout,
and shuts down cleanly on SIGTERM."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvwise.cli import build_parser
from kvwise.server import parse_api_keys

from .conftest import stop_serving, wait_until_serving


def test_parse_api_keys():
    assert parse_api_keys(["k1=alice"], "k2=bob, k3=bob") == {
        "k1": "alice",
        "k2": "bob",
        "k3": "bob",
    }
    assert parse_api_keys([], None) == {}
    assert parse_api_keys(["k=a=b"]) == {"k": "a=b"}
    for bad in (["nokey"], ["=tenant"], ["k="], ["k=a", "k=b"]):
        with pytest.raises(ValueError, match="^api_key: "):
            parse_api_keys(bad)
    with pytest.raises(ValueError) as info:
        parse_api_keys(["secret-key-123"])
    assert "secret-key-123" not in str(info.value)  # never echo a key


def test_serve_flags():
    args = build_parser().parse_args(
        ["serve", "--api-key", "a=x", "--api-key", "b=y", "--no-prefix-caching"]
    )
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, ["a=x", "b=y"])
    assert args.no_prefix_caching and args.max_waiting == 256
    assert (args.header_timeout, args.body_timeout, args.allowed_hosts) == (10.0, 30.0, [])
    args = build_parser().parse_args(["serve", "--header-timeout", "1.5", "--body-timeout", "2"])
    assert (args.header_timeout, args.body_timeout) == (1.5, 2.0)
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", "--body-timeout", bad])
        assert info.value.code == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_subprocess_sigterm(tmp_path):
    port = _free_port()
    env = {**os.environ, "KVWISE_API_KEYS": "sk-test=carol"}
    cmd = [sys.executable, "-m", "kvwise.cli", "serve", "--port", str(port)]
    cmd += ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--max-waiting", "4"]
    cmd += ["--kv-disk-path", str(tmp_path)]  # never the default directory another engine owns
    cmd += ["--header-timeout", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        assert httpx.post(base + "/v1/chat/completions", json=body).status_code == 401
        r = httpx.post(
            base + "/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer sk-test"},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["model"] == "SmolLM2-135M-Instruct"
        r = httpx.get(base + "/health", headers={"X-Big": "a" * (1 << 20)})
        assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_too_large"
        r = httpx.get(base + "/health", headers={"Host": "rebound.example"})
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            start = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # never finished
            answer = sock.recv(100)
            assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - start < 3
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    log = stop_serving(proc, timeout=30)
    assert proc.returncode == 0, log
    assert "tenant=carol" in log and "Shutting down" in log

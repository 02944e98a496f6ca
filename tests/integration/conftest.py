"""Real services for the integration tests: a ``redis-server`` binary started per session.

The tests skip (with a message) when ``redis-server`` is not installed, and FAIL under
``CI=true`` (``tests/services.py``); ``scripts/install.sh`` installs it with
``KVWISE_EXTRAS=test``. ``KVWISE_REDIS_SERVER`` names another binary.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.services import service_missing

REDIS_SERVER = (
    os.environ.get("KVWISE_REDIS_SERVER") or shutil.which("redis-server") or "/usr/bin/redis-server"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, no persistence; can be killed and restarted
    on the same port."""

    def __init__(
        self, directory: Path, password: str | None = None, extra: tuple[str, ...] = ()
    ) -> None:
        self.directory = directory
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.extra = extra  # more redis-server arguments

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, timeout_s: float = 5.0) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=timeout_s
        )

    def start(self) -> None:
        args = [REDIS_SERVER, "--save", "", "--appendonly", "no", "--port", str(self.port)]
        args += ["--bind", "127.0.0.1", "--dir", str(self.directory), "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = self.client(timeout_s=0.5)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                client.ping()
                break
            except (redis.exceptions.ConnectionError, OSError) as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port}: no PING") from exc
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would; the data is gone (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


def _require_binary() -> None:
    if not Path(REDIS_SERVER).exists():
        service_missing(
            f"redis-server not installed at {REDIS_SERVER} (apt-get install redis-server, or "
            "KVWISE_EXTRAS=test scripts/install.sh)"
        )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """The shared server of the session (``.url``, ``.port``, ``.proc``, ``.kill()``,
    ``.restart()``). Do not leave it with a password or other changed settings."""
    _require_binary()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_db(redis_server) -> RedisServer:
    """The shared server, running (restarted if a test killed it) and empty."""
    if not redis_server.running:
        redis_server.start()
    client = redis_server.client()
    client.flushall()
    client.close()
    return redis_server


@pytest.fixture
def start_redis(tmp_path) -> Iterator:
    """Start a dedicated server: ``start_redis(password="s3cret")``; stopped after the test."""
    _require_binary()
    servers: list[RedisServer] = []

    def start(password: str | None = None) -> RedisServer:
        server = RedisServer(tmp_path, password=password)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()


class RedisCluster:
    """Three cluster-enabled ``redis-server``s on 127.0.0.1 joined by ``redis-cli --cluster
    create`` (no replicas; serving whatever slots stay up when a node dies)."""

    def __init__(self, directory: Path, size: int = 3) -> None:
        self.nodes = []
        for i in range(size):
            node_dir = directory / f"node{i}"
            node_dir.mkdir()
            # the bus port on a free port of its own (by default port + 10000: maybe taken,
            # or past 65535 for an ephemeral port)
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-require-full-coverage", "no",
                     "--cluster-port", str(free_port()))  # fmt: skip
            self.nodes.append(RedisServer(node_dir, extra=extra))

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)  # fmt: skip
        deadline = time.monotonic() + 30
        while True:  # every node agrees the slots are assigned
            states = [node.client().cluster("info") for node in self.nodes]
            if all(s.get("cluster_state") == "ok" for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster did not come up: {states}")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisCluster]:
    """A fresh 3-node Redis Cluster (``.url``, ``.nodes``), stopped after the test."""
    _require_binary()
    cluster = RedisCluster(tmp_path)
    try:
        cluster.start()
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        cluster.stop()
        service_missing(f"no local Redis Cluster: {exc}")
    yield cluster
    cluster.stop()

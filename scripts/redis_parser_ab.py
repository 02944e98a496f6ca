"""Redis read throughput through redis-py with its C reply parser (hiredis) vs the pure-Python
one, interleaved: MGET of 16 entries of 5.5 MiB (a 2,048-token prefix of the default model),
on a throwaway loopback redis-server.

    .venv/bin/python scripts/redis_parser_ab.py [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import redis
from redis.connection import _HiredisParser, _RESP2Parser


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    directory = tempfile.mkdtemp()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--appendonly", "no", "--dir", directory],
        stdout=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        values = {f"k{i}": os.urandom(5_760_000) for i in range(16)}
        redis.Redis(port=port).mset(values)
        parsers = {"hiredis": _HiredisParser, "python": _RESP2Parser}
        clients = {
            name: redis.Redis(connection_pool=redis.ConnectionPool(port=port, parser_class=cls))
            for name, cls in parsers.items()
        }
        times: dict[str, list[float]] = {name: [] for name in clients}
        for _ in range(args.reps):
            for name, client in clients.items():
                t = time.perf_counter()
                client.mget(list(values))
                times[name].append(time.perf_counter() - t)
        total_mb = sum(len(v) for v in values.values()) / 1e6
        for name, samples in times.items():
            med = statistics.median(samples)
            print(f"{name:8s} median {med * 1e3:6.1f} ms  {total_mb / med:6.0f} MB/s")
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()

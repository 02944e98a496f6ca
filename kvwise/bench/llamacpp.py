"""llama.cpp as a benchmark peer: its own ``llama-bench`` and ``llama-server`` binaries.

Run as llama.cpp's users run them: the same GGUF, the same thread count, flash attention on,
``llama-server`` with parallel slots and continuous batching (its prompt cache on, as by
default). The binaries come from ``--llama-cpp DIR`` (the build's ``bin`` directory), else
``$KVWISE_LLAMA_CPP``, else ``PATH``; docs/BENCHMARKS.md says how to build them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_binary(name: str, directory: str | None = None) -> str | None:
    """Path of llama.cpp's ``name`` (``llama-bench``, ``llama-server``), or None."""
    for where in (directory, os.environ.get("KVWISE_LLAMA_CPP")):
        if where and (Path(where) / name).is_file():
            return str(Path(where) / name)
    return shutil.which(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_bench(binary: str, model: str, threads: int, *extra: str) -> list[dict]:
    """One ``llama-bench`` run (``-o json``), flash attention on; rows as it reports them."""
    cmd = [binary, "-m", model, "-t", str(threads), "-fa", "1", "-r", "1", "-o", "json", *extra]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


class LlamaServer:
    """``llama-server`` on a free loopback port for the duration of a ``with`` block."""

    def __init__(self, binary: str, model: str, threads: int, slots: int, slot_ctx: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            binary,
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(slots * slot_ctx),
            "-kvu",
            "-fa",
            "on",
            "-cb",
        ]
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)

    def log_tail(self, lines: int = 20) -> str:
        """The end of the server's output (for reporting a failure)."""
        text = Path(self.log.name).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def __enter__(self) -> LlamaServer:
        import httpx

        from kvwise.bench.progress import phase

        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        with phase(f"starting llama-server on {self.url}"):
            deadline = time.time() + 300
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            self.__exit__()
            raise RuntimeError("llama-server did not become ready in 300 s")

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

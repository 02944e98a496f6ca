"""Seconds from starting ``kvwise serve`` to its first answered chat request (issue 44's "a
first answer in 10 s"): start the server, poll ``/health`` every 50 ms, send one chat request
(8 tokens, greedy), stop the server; N runs, each with a fresh ``$XDG_CACHE_HOME`` (a fresh
machine's empty disk tier; torch's kernel build directory stays where it was), and the median.

    .venv/bin/python scripts/first_answer_time.py --runs 5 --port 18431
    # another checkout, same venv:
    PYTHONPATH=/tmp/old .venv/bin/python scripts/first_answer_time.py --kvwise "-m kvwise.cli"
    # the README's command, install check included (it serves: no "serve" is added)
    .venv/bin/python scripts/first_answer_time.py --serving-command "bash scripts/run.sh"

Prints one line per run (start → /health up, → first answer, the server's peak RSS) and the
medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def _get(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _peak_rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def one_run(
    command: list[str], port: int, timeout_s: float, serve: bool = True
) -> tuple[float, float, float]:
    """(seconds to /health up, seconds to the first answer, peak RSS MiB) of one start;
    ``serve``: add the ``serve`` subcommand to ``command``."""
    env = dict(os.environ)
    env.setdefault(
        "TORCH_EXTENSIONS_DIR",
        os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"
        ),
    )
    env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="kvwise-first-answer-")
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*command, *(["serve"] if serve else []), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError("the server did not come up")
            try:
                _get(f"{base}/health", timeout=1.0)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
        up = time.perf_counter() - start
        body = {
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        _get(f"{base}/v1/chat/completions", body)
        answered = time.perf_counter() - start
        return up, answered, _peak_rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--kvwise", default=None, help="the kvwise command (default: this venv's)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument(
        "--serving-command",
        default=None,
        help="a command that serves by itself, given --port (e.g. 'bash scripts/run.sh')",
    )
    args = p.parse_args()
    if args.serving_command is not None:
        command = shlex.split(args.serving_command)
    elif args.kvwise is None:
        command = [os.path.join(os.path.dirname(sys.executable), "kvwise")]
    else:
        command = shlex.split(args.kvwise)
        if command[0] == "-m":
            command = [sys.executable, *command]
    ups, answers = [], []
    for i in range(args.runs):
        up, answered, rss = one_run(
            command, args.port, args.timeout, serve=args.serving_command is None
        )
        ups.append(up)
        answers.append(answered)
        print(
            f"run {i + 1}: /health up {up:.2f} s, first answer {answered:.2f} s, "
            f"peak RSS {rss:.0f} MiB",
            flush=True,
        )
    print(
        f"median of {args.runs}: /health up {statistics.median(ups):.2f} s, first answer "
        f"{statistics.median(answers):.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A kvwise server's CPU use and its running / waiting requests over time, and their plot.

    python scripts/server_timeline.py record --out /tmp/tiers.json   # beside a benchmark
    python scripts/server_timeline.py plot tiers.json pool.json --out docs/timeline.png

``record`` waits for a ``kvwise serve`` process to start (the first whose command line holds
``kvwise.cli serve``, or ``--pid``), then every ``--every`` seconds until it exits reads its
CPU seconds (``/proc/PID/stat``: user + system, over wall time: 2.0 = both cores busy) and the
``kvwise_requests_running`` / ``kvwise_requests_waiting`` gauges of its ``/metrics``. ``plot``
draws one panel per file. A benchmark tool (Linux only): nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx


def _server_pid() -> int:
    while True:
        found = subprocess.run(
            ["pgrep", "-f", "kvwise.cli serve"], capture_output=True, text=True
        ).stdout.split()
        if found:
            return int(found[0])
        time.sleep(0.5)


def _gauge(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)", text, re.M)
    return float(match.group(1)) if match else float("nan")


def record(pid: int | None, every: float) -> list[dict]:
    pid = pid or _server_pid()
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/metrics"
    ticks, rows, last, t0 = os.sysconf("SC_CLK_TCK"), [], None, time.perf_counter()
    while Path(f"/proc/{pid}").exists():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().split()
            metrics = httpx.get(url, timeout=5).text
        except (OSError, httpx.HTTPError):  # starting up, or gone between the two reads
            time.sleep(every)
            continue
        now, cpu = time.perf_counter() - t0, (int(stat[13]) + int(stat[14])) / ticks
        if last is not None:
            rows.append({"t_s": round(now, 2), "cpus": round((cpu - last[1]) / (now - last[0]), 3),
                         "running": _gauge(metrics, "kvwise_requests_running"),
                         "waiting": _gauge(metrics, "kvwise_requests_waiting")})  # fmt: skip
        last = (now, cpu)
        time.sleep(every)
    return rows


def plot(files: list[Path], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(files), 1, figsize=(10, 2.6 * len(files)), squeeze=False)
    for axis, path in zip(axes[:, 0], files):
        rows = json.loads(path.read_text())
        t = [r["t_s"] for r in rows]
        axis.fill_between(t, [r["cpus"] for r in rows], step="pre", alpha=0.35,
                          label="CPUs busy (server process)")  # fmt: skip
        axis.set_ylabel("CPUs")
        axis.set_title(path.stem)
        right = axis.twinx()
        right.step(t, [r["running"] for r in rows], color="#d62728", label="running")
        right.step(t, [r["waiting"] for r in rows], color="#2ca02c", label="waiting")
        right.set_ylabel("requests")
        lines = axis.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        axis.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the server process started")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--pid", type=int)
    r.add_argument("--every", type=float, default=2.0)
    r.add_argument("--out", required=True)
    q = sub.add_parser("plot")
    q.add_argument("files", nargs="+", type=Path)
    q.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "record":
        Path(args.out).write_text(json.dumps(record(args.pid, args.every)))
    else:
        plot(args.files, args.out)


if __name__ == "__main__":
    main()

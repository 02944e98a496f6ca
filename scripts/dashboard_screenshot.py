"""A screenshot of kvwise's live dashboard under load (docs/dashboard.png).

Starts ``kvwise serve`` on a free loopback port (the default model, a disk tier in a fresh
temporary directory, a small KV pool and waiting queue, so that the tiers, the cost model's
decisions and 429s all show, an API key per tenant and an admin key), drives it with one
``kvwise bench load --url`` per tenant (concurrent streaming chat clients sharing one system
prompt, ``--clients`` split between the tenants), and near the end of the load takes a
screenshot of /dashboard in headless Chromium (Playwright driving the system ``chromium``).

    .venv/bin/python scripts/dashboard_screenshot.py            # docs/dashboard.png
    .venv/bin/python scripts/dashboard_screenshot.py --duration 90 --clients 24 --out x.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvwise.bench.common import wait_ready

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    p.add_argument("--duration", type=float, default=75.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--kv-cache-memory", default="64MiB", help="the device pool (small: tiers)")
    p.add_argument("--max-waiting", type=int, default=6, help="past it: 429")
    p.add_argument("--shot-before-end", type=float, default=8.0, help="seconds before the end")
    p.add_argument("--tenants", type=int, default=2, help="tenants, an API key each")
    p.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = p.parse_args()
    if not os.access(args.chromium, os.X_OK):
        raise SystemExit(f"no chromium at {args.chromium}: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    kvwise = [sys.executable, "-m", "kvwise.cli"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kvwise-shot-") as disk:
        serve = kvwise + ["serve", "--port", str(port), "--kv-disk-path", disk]
        serve += ["--kv-cache-memory", args.kv_cache_memory, "--max-waiting", str(args.max_waiting)]
        keys = [f"key-{i}" for i in range(args.tenants)]
        for i, key in enumerate(keys):
            serve += ["--api-key", f"{key}=tenant-{chr(ord('a') + i)}"]
        admin = "admin-" + os.urandom(8).hex()
        print("$", " ".join(serve), "--admin-key ...")
        serve += ["--admin-key", admin]
        server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(url, server, timeout=180)
            loaders = []
            for i, key in enumerate(keys):  # the clients split, the first tenants the busier
                clients = args.clients // len(keys) + (i < args.clients % len(keys))
                load = kvwise + ["bench", "load", "--url", url, "--clients", str(clients)]
                load += ["--duration", str(args.duration), "--max-tokens", str(args.max_tokens)]
                load += ["--api-key", key]
                print("$", " ".join(load))
                loaders.append(subprocess.Popen(load, stderr=subprocess.DEVNULL))
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=args.chromium, headless=True, args=["--no-sandbox"]
                )
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{url}/dashboard?key={admin}")
                time.sleep(max(1.0, args.duration - args.shot_before_end))
                page.screenshot(path=args.out, full_page=True)
                browser.close()
            print(f"wrote {args.out}")
            for loader in loaders:
                loader.wait(timeout=args.duration + 120)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

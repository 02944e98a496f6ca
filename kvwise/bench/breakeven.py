"""``kvwise bench breakeven``: TTFT against prefix length, recompute vs a hit from each tier.

(Being written: the argument list is final, ``main`` is not.)
"""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lengths",
        default="16,64,256,1024,2048,4096",
        help="prefix lengths in tokens, comma-separated (the model's context is the limit)",
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions per point (median)")
    p.add_argument("--tiers", default="host,disk,redis", help="tiers to measure")
    p.add_argument(
        "--redis-url",
        default=None,
        help="Redis for the redis tier (default: start redis-server on a loopback port)",
    )
    p.add_argument("--chunk-blocks", default=None, help="entry sizes to compare, e.g. 1,4,8,16")
    p.add_argument("--plot", default="docs/breakeven.png", help="write the PNG plot here")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    raise SystemExit("kvwise bench breakeven: not written yet")

"""``kvwise claims``: the break-even a published KV-cache speedup implies. Pure Python.

A claim states a context length N, and the time to recompute its prefix (prefill) R and to
load it from the cache L — or only their ratio, the speedup S = R / L. Below some prefix
length, recomputing is faster than loading; where depends on how load time grows with the
prefix, which no claim states. Each model below assumes prefill time grows linearly with the
prefix (R·n/N; attention's quadratic term only makes short prefixes cheaper still, so every
break-even here is a lower bound) and says what it assumes of the load:

- ``fixed load`` (the first seed article's arithmetic): loading takes L whatever the length:
  break-even n* = N·L/R = N/S.
- ``bandwidth``: load time is proportional to the KV bytes, L·n/N: the ratio is S at every
  length, so loading wins down to the shortest prefix — no break-even.
- ``latency + bandwidth``: a fixed latency t0 (a request's round trip, an open, a seek) plus
  bytes over bandwidth, L(n) = t0 + (L − t0)·n/N: n* = N·t0 / (R − L + t0), between 0 (t0 = 0)
  and N/S (t0 = L). Without R and L (a bare speedup) it needs them in seconds, not only S.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

# load latencies the latency + bandwidth model is evaluated at when none is given (seconds):
# a local NVMe read, a network round trip to a cache server, an object-store request
DEFAULT_LATENCIES_S = (0.0001, 0.001, 0.01)


@dataclass(frozen=True)
class Claim:
    """What a claim states. ``load_s`` or ``speedup`` (or both, if consistent)."""

    context_tokens: int
    recompute_s: float | None = None
    load_s: float | None = None
    speedup: float | None = None
    model: str | None = None
    hardware: str | None = None
    source: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        n = self.context_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"context: expected a positive number of tokens, got {n!r}")
        for name in ("recompute_s", "load_s", "speedup"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
            ):
                field_name = name.removesuffix("_s")
                raise ValueError(f"{field_name}: expected a positive number, got {value!r}")
        r, load, s = self.recompute_s, self.load_s, self.speedup
        if load is None and s is None:
            raise ValueError("load: give the load time or the speedup (a claim needs one)")
        if r is not None and load is not None:
            if load >= r:
                raise ValueError(
                    f"load: {load} s is not faster than recomputing ({r} s): no speedup to explain"
                )
            if s is not None and not math.isclose(s, r / load, rel_tol=0.05):
                raise ValueError(f"speedup: {s} disagrees with recompute / load = {r / load:.1f}")
        if s is not None and s <= 1:
            raise ValueError(f"speedup: {s} is not a speedup (expected > 1)")

    @property
    def ratio(self) -> float:
        """S = R / L."""
        if self.recompute_s is not None and self.load_s is not None:
            return self.recompute_s / self.load_s
        return float(self.speedup)

    def fixed_load_breakeven(self) -> float:
        return self.context_tokens / self.ratio

    def latency_breakeven(self, latency_s: float) -> float | None:
        """n* for a load latency ``latency_s`` (None: the claim has no times in seconds)."""
        if latency_s < 0:
            raise ValueError(f"load_latency: expected >= 0 s, got {latency_s}")
        if self.recompute_s is None:
            return None
        r = self.recompute_s
        load = self.load_s if self.load_s is not None else r / self.ratio
        if latency_s > load:
            raise ValueError(
                f"load_latency: {latency_s} s is longer than the whole load ({load:.3g} s)"
            )
        return self.context_tokens * latency_s / (r - load + latency_s)

    def missing(self) -> list[str]:
        """What the claim omits that would pin the break-even down."""
        out = []
        if self.recompute_s is None or (self.load_s is None and self.speedup is None):
            out.append("the recompute and load times in seconds (only their ratio is stated)")
        out.append("how load time grows with the prefix (its fixed latency vs its bandwidth)")
        out.append("the speedup at shorter prefixes (one length measured)")
        if self.model is None:
            out.append("the model (KV bytes per token, FLOPs per token)")
        if self.hardware is None:
            out.append("the hardware (FLOP/s and clocks for prefill; the storage path for loads)")
        return out


def implied_bandwidth(claim: Claim, kv_bytes_per_token: float, latency_s: float = 0.0):
    """Bytes per second the load must have moved: the prefix's KV bytes over the load time
    less its fixed latency (None without a load time in seconds)."""
    if kv_bytes_per_token <= 0:
        raise ValueError(
            f"kv_bytes_per_token: expected a positive number, got {kv_bytes_per_token}"
        )
    load = claim.load_s
    if load is None and claim.recompute_s is not None:
        load = claim.recompute_s / claim.ratio
    if load is None or latency_s >= load:
        return None
    return claim.context_tokens * kv_bytes_per_token / (load - latency_s)


def report(
    claim: Claim, latencies_s=DEFAULT_LATENCIES_S, kv_bytes_per_token: float | None = None
) -> str:
    n = claim.context_tokens
    lines = []
    if claim.source:
        lines.append(claim.source)
    stated = [f"{n:,} tokens of context"]
    if claim.recompute_s is not None:
        stated.append(f"recompute {claim.recompute_s:g} s")
    if claim.load_s is not None:
        stated.append(f"load {claim.load_s:g} s")
    stated.append(f"speedup {claim.ratio:.1f}x")
    if claim.model:
        stated.append(f"model: {claim.model}")
    if claim.hardware:
        stated.append(f"hardware: {claim.hardware}")
    lines.append("stated: " + ", ".join(stated))
    for note in claim.notes:
        lines.append(f"note: {note}")
    lines.append("implied break-even (recomputing is faster below it; prefill assumed linear, so")
    lines.append("each is a lower bound):")
    took = f"{claim.load_s:g} s" if claim.load_s is not None else "its (unstated) time"
    lines.append(
        f"  fixed load      loading takes {took} at any length:"
        f" {claim.fixed_load_breakeven():,.0f} tokens (= context / speedup)"
    )
    lines.append("  bandwidth       load time proportional to the KV bytes: no break-even; the")
    lines.append(f"                  ratio is {claim.ratio:.1f}x at every length")
    if claim.recompute_s is None:
        lines.append("  latency + bw    needs the times in seconds; the claim gives only a ratio")
    else:
        for t0 in latencies_s:
            value = claim.latency_breakeven(t0)
            lines.append(
                f"  latency + bw    fixed latency {t0 * 1000:g} ms, the rest bandwidth:"
                f" {value:,.0f} tokens"
            )
    if kv_bytes_per_token is not None:
        total = claim.context_tokens * kv_bytes_per_token
        bw = implied_bandwidth(claim, kv_bytes_per_token)
        moved = f"{total / 1e9:.1f} GB of KV ({kv_bytes_per_token:,.0f} B/token)"
        if bw is None:
            lines.append(f"bandwidth: {moved}; the claim states no load time to divide it by")
        else:
            lines.append(f"bandwidth: {moved} in {total / bw:.3g} s: at least {bw / 1e9:.1f} GB/s")
    lines.append("omitted, and would pin it down: " + "; ".join(claim.missing()))
    return "\n".join(lines)


# the first seed article's four claims, with only the numbers each states (the article's
# reading of them in ``notes``)
EXAMPLES = (
    Claim(
        112_000,
        recompute_s=57.0,
        load_s=2.1,
        source="claim #1: 'Traditional recompute "
        "approach (112K token context): 57 seconds processing time; with KV Cache: 2.1 "
        "seconds loading time; Over 27X faster'",
    ),
    Claim(
        128_000,
        speedup=75.0,
        model="70 billion parameters",
        source="claim #2: 'up to 75X faster prefill times for long-context prompts'",
        notes=("the article: measured with a 128,000-token prefix, TTFT recompute vs load",),
    ),
    Claim(
        128_000,
        speedup=20.0,
        source="claim #3: '... TTFT by 20x using KV Cache Offload'",
        notes=("the article: made with 128K tokens, on a model bigger than claim #2's",),
    ),
    Claim(
        128_000,
        speedup=20.0,
        model="larger, large context multi-GPU models",
        source="claim #4: 'up to twenty times and six times respectively for larger, large "
        "context multi-GPU models'",
        notes=(
            "the article: the 20x is at 128K tokens; the 6x states no context, so it "
            "implies nothing here",
        ),
    ),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=int, default=None, help="context tokens of the claim")
    p.add_argument("--recompute", type=float, default=None, help="seconds to recompute it")
    p.add_argument("--load", type=float, default=None, help="seconds to load it")
    p.add_argument("--speedup", type=float, default=None, help="recompute / load, if no times")
    p.add_argument("--model", default=None, help="the model the claim names (text)")
    p.add_argument("--hardware", default=None, help="the hardware the claim names (text)")
    p.add_argument(
        "--load-latency",
        type=float,
        action="append",
        default=None,
        metavar="SECONDS",
        help="fixed load latency for the latency + bandwidth "
        "model (repeatable; default 0.1 ms, 1 ms, 10 ms)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=float,
        default=None,
        help="the model's KV bytes per token (kvwise size prints it): the load's implied bandwidth",
    )
    p.add_argument("--examples", action="store_true", help="the seed article's four claims")


def main(args: argparse.Namespace) -> int:
    latencies = tuple(args.load_latency) if args.load_latency else DEFAULT_LATENCIES_S
    if args.examples:
        print("\n\n".join(report(c, latencies) for c in EXAMPLES))
        return 0
    if args.context is None:
        raise ValueError("context: give --context (tokens), or --examples")
    claim = Claim(args.context, args.recompute, args.load, args.speedup, args.model, args.hardware)
    print(report(claim, latencies, args.kv_bytes_per_token))
    return 0

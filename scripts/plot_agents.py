"""Plot ``kvwise bench agents`` results: turns/s and post-tool latency per configuration.

  python scripts/plot_agents.py docs/bench/agents.json docs/bench/agents_vs_llamacpp.json \
      --out docs/agents.png
  python scripts/plot_agents.py docs/bench/agents_peers.json --out docs/agents_peers.png

Each file's configurations are drawn side by side (a later file's kvwise runs are labelled
with the file they came from). A benchmark tool: nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", default="docs/agents.png")
    args = p.parse_args()
    rows, shape = [], None
    for i, path in enumerate(args.files):
        data = json.loads(path.read_text())
        shape = shape or data.get("args") or {}
        for name, r in data["results"].items():
            label = name if i == 0 or name in ("llama.cpp", "vllm") else f"{name} (run {i + 1})"
            rows.append((label, r))
    labels = [label for label, _ in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    if all("turns_per_in_flight_s" in r for _, r in rows):  # the server's rate beside the wall's
        left.bar([i - 0.2 for i in x], [r["turns_per_s"] for _, r in rows], 0.4,
                 label="per s of wall time (tools' sleeps included)")  # fmt: skip
        left.bar([i + 0.2 for i in x], [r["turns_per_in_flight_s"] for _, r in rows], 0.4,
                 label="per s with a turn in flight")  # fmt: skip
        left.set_xticks(list(x), labels)
        left.set_ylabel("model turns / s")
        left.legend()
    else:
        left.bar(labels, [r["turns_per_s"] for _, r in rows], color="#1f77b4")
        left.set_ylabel("model turns / s (wall time, tools' sleeps included)")
    bars = [("post_tool_p50_s", "answer p50"), ("post_tool_p99_s", "answer p99")]
    if all("post_tool_ttft_p50_s" in r for _, r in rows):  # streamed runs: their TTFT too
        bars = [bars[0], ("post_tool_ttft_p50_s", "TTFT p50"), ("post_tool_ttft_p99_s", "TTFT p99")]
    width = 0.8 / len(bars)
    for k, (key, label) in enumerate(bars):
        offset = (k - (len(bars) - 1) / 2) * width
        right.bar([i + offset for i in x], [r[key] for _, r in rows], width, label=label)
    right.set_xticks(list(x), labels)
    right.set_ylabel("latency of turns after a tool result (s)")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=20)
    fig.suptitle(
        f"kvwise bench agents: {shape.get('agents', 8)} agents x {shape.get('rounds', 6)} tool "
        f"rounds, pool {shape.get('pool_memory', '300MiB')} (1/4 of their contexts)"
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()

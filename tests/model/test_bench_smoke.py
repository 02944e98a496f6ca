"""The benchmarks still run end to end against the engine's API (tiny sizes: this checks that
they work, not what they measure — the figures come from the full runs in BENCHMARKS.md)."""

import json

from kvwise.cli import main


def test_bench_throughput_runs(tmp_path):
    out = tmp_path / "throughput.json"
    args = ["bench", "throughput", "--no-peer", "--reps", "1", "--decode-tokens", "4"]
    args += ["--batch", "2", "--prefill-lens", "32", "--kv-cache-memory", "64MiB"]
    assert main([*args, "--out", str(out)]) == 0
    assert json.loads(out.read_text())


def test_bench_breakeven_runs(tmp_path):
    out, plot = tmp_path / "breakeven.json", tmp_path / "breakeven.png"
    args = ["bench", "breakeven", "--lengths", "16,32", "--reps", "1", "--tiers", "host,disk"]
    args += ["--kv-cache-memory", "64MiB", "--plot", str(plot)]  # disk: its own temp dir
    assert main([*args, "--out", str(out)]) == 0
    assert json.loads(out.read_text()) and plot.stat().st_size > 0

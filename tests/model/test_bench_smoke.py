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


def test_bench_chat_runs(tmp_path):
    out = tmp_path / "chat.json"
    args = ["bench", "chat", "--no-llama-cpp", "--conversations", "2", "--turns", "2"]
    args += ["--turn-tokens", "40", "--max-tokens", "4"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    ttfts = result["median_ttft_s"]["kvwise"]
    assert len(ttfts) == 2 and all(t > 0 for t in ttfts)
    sizes = result["runs"]["kvwise"][0]["prompt_tokens"]
    assert sizes[1][0] > sizes[0][0] > 40  # the second turn carries the first one's history


def test_bench_breakeven_compares_kv_formats(tmp_path):
    out, plot = tmp_path / "formats.json", tmp_path / "formats.png"
    args = ["bench", "breakeven", "--lengths", "16,32", "--reps", "1", "--tiers", "disk"]
    args += ["--kv-formats", "float32,int8", "--kv-cache-memory", "64MiB", "--plot", str(plot)]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())["kv_formats"]
    assert set(result) == {"float32", "int8"} and plot.stat().st_size > 0
    assert result["int8"]["bytes_per_token"] < result["float32"]["bytes_per_token"] / 3.5

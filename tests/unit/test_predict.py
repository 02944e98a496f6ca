"""kvwise breakeven --predict: the roofline's arithmetic (checked by hand, not by calling the
code twice), the break-even search, the fits that calibrate this machine, the presets, and the
inputs refused naming the field."""

from __future__ import annotations

import json

import pytest

from kvwise.cli import main
from kvwise.perf.model_shape import MODELS, model_shape
from kvwise.perf.roofline import (
    HARDWARE,
    Hardware,
    Roofline,
    Tier,
    hardware_preset,
    load_machine,
    parse_tier,
    save_machine,
)
from kvwise.perf.roofline_fit import fit_steps, fit_tier, least_squares

LLAMA70 = MODELS["llama-3-70b"]
SMOL = MODELS["smollm2-135m"]
H100 = HARDWARE["h100-sxm"]
NVME = parse_tier("nvme-gen4")


def test_model_shapes_count_what_their_papers_say():
    assert LLAMA70.total_params == pytest.approx(70.6e9, rel=0.01)  # "70B"
    assert LLAMA70.kv_bytes_per_token("float16") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert SMOL.total_params == pytest.approx(134.5e6, rel=0.01)  # tied embeddings: 135M
    assert SMOL.kv_bytes_per_token("float16") == 23_040
    assert SMOL.kv_bytes_per_token("float32") == 46_080  # what kvwise's pool holds by default
    # a quantized format with its scales, as the pool stores it (kvwise size's figure)
    assert SMOL.kv_bytes_per_token("int8") == 11_520 + 2 * 30 * 3 * 4 == 12_240
    assert model_shape("default") is SMOL
    assert model_shape("Llama-3-70B") is LLAMA70
    given = model_shape("layers=80,hidden=8192,intermediate=28672,heads=64,kv_heads=8,vocab=128256")
    assert given.total_params == LLAMA70.total_params  # head_dim = hidden / heads
    assert given.kv_bytes_per_token("float16") == 327_680


def test_a_compute_bound_prefill_is_its_flops_over_the_fraction_of_peak():
    roof = Roofline(LLAMA70, H100)
    n = 4096  # prefix; n + 1 tokens prefilled in one forward (no chunking on the GPU presets)
    q = n + 1
    flops = 2 * LLAMA70.linear_params * q + 2 * 8192 * 128256
    attn = 4 * 80 * 64 * 128 * q * (q + 1) / 2
    assert roof.recompute_s(n) == pytest.approx((flops + attn) / (0.5 * 989e12))


def test_one_token_is_memory_bound_the_weights_read_once():
    roof = Roofline(LLAMA70, H100)
    weights = LLAMA70.total_params * 2  # bf16
    assert roof.forward_s(1, 0) == pytest.approx((weights + 327_680) / 3.35e12)  # ~42 ms
    # so a short prefill costs the same as one token: recompute is flat until compute dominates
    assert roof.recompute_s(10) == pytest.approx((weights + 11 * 327_680) / 3.35e12)


def test_a_load_is_latency_plus_bytes_over_bandwidth_then_the_last_tokens_forward():
    roof = Roofline(LLAMA70, H100)
    n = 8192
    read = 100e-6 + n * 327_680 / 7e9
    assert roof.load_s(n, NVME) == pytest.approx(read + roof.forward_s(1, n))
    streamed = Roofline(LLAMA70, H100, overlap=True).load_s(n, NVME)
    assert roof.forward_s(1, n) < streamed < roof.load_s(n, NVME)


def test_chunked_prefill_sums_its_chunks():
    hw = H100.replace(prefill_chunk=512, step_overhead_s=1e-3, request_overhead_s=2e-3)
    roof = Roofline(SMOL, hw)
    expected = 2e-3 + roof.forward_s(512, 0) + roof.forward_s(512, 512) + roof.forward_s(1, 1024)
    assert roof.recompute_s(1024) == pytest.approx(expected)
    assert roof.forward_s(512, 0) >= 1e-3  # the step overhead on every forward


def test_the_break_even_is_the_first_length_loading_wins():
    roof = Roofline(LLAMA70, H100)
    n = roof.break_even(NVME)
    assert n is not None
    assert roof.load_s(n, NVME) < roof.recompute_s(n)
    assert roof.load_s(n - 1, NVME) >= roof.recompute_s(n - 1)
    # by hand: recompute is memory-bound (W/B) up to where compute takes over, then grows at
    # 2P/(0.5 peak) per token; the load is W/B + 100 us + n x 46.8 us: they cross near 183
    assert 150 < n < 220
    # even an instant tier only wins once the prefill stops being memory-bound (a short
    # prefill costs one weight read, as the last token's forward does); a slow one never wins
    instant = roof.break_even(Tier("instant", 0.0, 1e18))
    assert instant < n
    assert roof.recompute_s(instant - 1) == pytest.approx(roof.forward_s(1, instant - 1), 1e-3)
    assert roof.break_even(Tier("slow", 1.0, 1e6), max_tokens=1 << 16) is None


def test_a_small_model_on_a_fast_gpu_hardly_ever_pays_to_load_from_nvme():
    roof = Roofline(SMOL, H100)
    # recomputing a token takes 2 x 0.11 GFLOP / 495 TFLOP/s = 0.4 ns; loading its 23 KB from
    # NVMe 3.3 us: only attention's quadratic term ever lets the load win
    assert roof.break_even(NVME) > 30_000
    assert roof.break_even(parse_tier("host-pcie5")) < 2_000


def test_least_squares_and_the_fits_recover_known_parameters():
    assert least_squares([[1, 0], [1, 1], [1, 2]], [1, 3, 5]) == pytest.approx([1, 2])
    tier = fit_tier("disk", [(1e6, 0.002 + 1e6 / 1e9), (1e8, 0.002 + 1e8 / 1e9)], "test")
    assert tier.latency_s == pytest.approx(0.002)
    assert tier.bandwidth == pytest.approx(1e9)
    truth = Hardware("cpu", 400e9, 30e9, mfu=0.45, attn_fraction=0.2, step_overhead_s=0.008,
                     weight_dtype="float32", kv_dtype="float32")  # fmt: skip
    roof = Roofline(SMOL, truth)
    prefill = [(q, c, roof.forward_s(q, c)) for q, c in [(64, 0), (512, 0), (512, 2048)]]
    decode = [(c, roof.forward_s(1, c)) for c in (64, 512, 2048)]
    draft = truth.replace(mfu=0.5, attn_fraction=None, step_overhead_s=0.0)
    fitted = fit_steps(SMOL, draft, prefill, decode)
    assert fitted.step_overhead_s == pytest.approx(0.008)
    assert fitted.mfu == pytest.approx(0.45)
    assert fitted.attn_fraction == pytest.approx(0.2)


def test_a_calibration_file_round_trips(tmp_path):
    hw = Hardware("this machine", 400e9, 30e9, tiers=(Tier("host", 1e-3, 4e9, "measured"),))
    path = tmp_path / "m.json"
    save_machine(path, hw, {"reps": 1})
    assert load_machine(path) == hw
    assert hardware_preset("this-machine", path) == hw
    path.write_text(json.dumps({"hardware": {"name": "x"}}))
    with pytest.raises(ValueError, match="machine: .* not a calibration file"):
        load_machine(path)
    with pytest.raises(ValueError, match="machine: no calibration at .*--calibrate"):
        load_machine(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: hardware_preset("h1000"), "hardware: unknown preset 'h1000'"),
        (lambda: model_shape("gpt-5"), "model: unknown preset or missing path 'gpt-5'"),
        (lambda: model_shape("layers=2,hidden=64"), "model: the shape lacks intermediate"),
        (lambda: model_shape("layers=2,width=64"), "model: unknown dimension 'width'"),
        (lambda: model_shape("layers=x"), "model: layers must be an integer"),
        (lambda: parse_tier("tape"), "tier: unknown preset or bad spec 'tape'"),
        (lambda: parse_tier("remote=x:10"), "tier: unknown preset or bad spec"),
        (lambda: parse_tier("remote=-1:10"), "latency must be >= 0"),
        (lambda: parse_tier("remote=1:0"), "bandwidth must be > 0"),
        (lambda: H100.replace(mfu=0.0), "mfu: expected a fraction"),
        (lambda: H100.replace(mfu=1.5), "mfu: expected a fraction"),
        (lambda: H100.replace(kv_dtype="fp3"), "kv_dtype: expected one of"),
        (lambda: H100.replace(peak_flops=-1.0), "peak_flops: expected a positive number"),
        (lambda: Roofline(SMOL, H100, gpus=0), "gpus: expected at least 1"),
    ],
)
def test_bad_input_is_refused_naming_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_custom_tiers_parse_as_latency_ms_and_gb_per_s():
    tier = parse_tier("remote=0.5:10")
    assert (tier.name, tier.latency_s, tier.bandwidth) == ("remote", 0.5e-3, 10e9)


def test_the_command_prints_each_tiers_break_even_and_draws_the_plot(tmp_path, capsys):
    png, out = tmp_path / "p.png", tmp_path / "p.json"
    args = [
        "breakeven",
        "--predict",
        "--model",
        "llama-3-70b",
        "--gpus",
        "2",
        "--tiers",
        "host-pcie5,nvme-gen4,net-100g",
        "--plot",
        str(png),
        "--out",
        str(out),
    ]
    assert main(args) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "Llama-3-70B on H100 SXM x 2" in text
    assert "break-even, nvme:" in text and "break-even, net-100g:" in text
    assert png.stat().st_size > 10_000
    result = json.loads(out.read_text())
    assert set(result["tiers"]) == {"host", "nvme", "net-100g"}
    assert main(["breakeven", "--predict"]) == 0  # the defaults: the default model, H100
    assert main(["breakeven", "--predict", "--model", "llama-3-70b"]) == 0
    assert "do not fit 1 x 80 GB" in capsys.readouterr().out  # 141 GB of weights


def test_the_command_refuses_unknown_presets_with_exit_2(capsys):
    assert main(["breakeven", "--predict", "--hardware", "h1000"]) == 2
    assert "hardware: unknown preset 'h1000'" in capsys.readouterr().err
    assert main(["breakeven", "--predict", "--tiers", "floppy"]) == 2
    assert main(["breakeven"]) == 2  # neither --predict nor --calibrate
    assert main(["breakeven", "--predict", "--hardware", "this-machine", "--machine",
                 "/nonexistent/m.json"]) == 2  # fmt: skip
    assert "--calibrate" in capsys.readouterr().err


def test_validation_compares_at_the_three_lengths(tmp_path, capsys):
    hw = H100.replace(tiers=(Tier("host", 1e-3, 4e9, "measured"),))
    machine = tmp_path / "m.json"
    save_machine(machine, hw, {})
    roof = Roofline(SMOL, hw)
    lengths = [256, 1024, 4096]
    measured = {
        "lengths": lengths,
        "median_ttft_s": {
            "recompute": [roof.recompute_s(n) * 1.1 for n in lengths],
            "host load": [roof.load_s(n, hw.tiers[0]) * 0.9 for n in lengths],
        },
    }
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(measured))
    out = tmp_path / "p.json"
    args = ["breakeven", "--predict", "--hardware", "this-machine", "--machine", str(machine),
            "--validate", str(bench), "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = json.loads(out.read_text())["validation"]
    assert len(rows) == 6
    for r in rows:
        expected = 1 / 1.1 - 1 if r["curve"] == "recompute" else 1 / 0.9 - 1
        assert r["error"] == pytest.approx(expected)
    assert "worst at 256, 1,024 and 4,096 tokens: 11% (within 25%)" in capsys.readouterr().out


def test_the_fit_picks_the_step_form_that_fits_compute_after_memory():
    # a CPU whose steps read the weights and then compute (no overlap): the sum form fits
    truth = Hardware("cpu", 400e9, 28e9, mfu=0.75, attn_fraction=0.55, step_overhead_s=0.007,
                     prefill_overhead_s=0.012, memory_overlap=False, weight_dtype="float32",
                     kv_dtype="float32")  # fmt: skip
    roof = Roofline(SMOL, truth)
    prefill = [(q, c, roof.forward_s(q, c)) for q, c in [(64, 0), (192, 0), (512, 0), (512, 2048)]]
    decode = [(c, roof.forward_s(1, c)) for c in (64, 512, 2560)]
    fitted = fit_steps(SMOL, truth.replace(memory_overlap=True, mfu=0.5), prefill, decode)
    assert fitted.memory_overlap is False
    assert fitted.mfu == pytest.approx(0.75, rel=1e-3)
    assert fitted.attn_fraction == pytest.approx(0.55, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(0.007, rel=1e-3)
    assert fitted.prefill_overhead_s == pytest.approx(0.012, rel=1e-3)
    # one token: the step overhead and the memory time, its few FLOPs; no prefill overhead
    assert roof.forward_s(1, 64) < 0.007 + roof.memory_s(1, 64) + 0.002
    assert roof.forward_s(64, 0) == pytest.approx(
        0.007
        + 0.012
        + (2 * SMOL.linear_params * 64 + 2 * 576 * 49152) / (0.75 * 400e9)
        + SMOL.attention_flops(64, 0) / (0.55 * 400e9)
        + (SMOL.total_params * 4 + 64 * 46_080) / 28e9
    )


def test_validation_needs_the_three_lengths_and_reports_the_others_too(tmp_path, capsys):
    hw = H100.replace(tiers=(Tier("host", 1e-3, 4e9, "measured"),))
    machine = tmp_path / "m.json"
    save_machine(machine, hw, {})
    roof = Roofline(SMOL, hw)

    def bench(lengths):
        path = tmp_path / f"b{len(lengths)}.json"
        med = {"recompute": [roof.recompute_s(n) for n in lengths],
               "host load": [roof.load_s(n, hw.tiers[0]) * 2 for n in lengths]}  # fmt: skip
        path.write_text(json.dumps({"lengths": lengths, "median_ttft_s": med}))
        return str(path)

    args = ["breakeven", "--predict", "--hardware", "this-machine", "--machine", str(machine)]
    assert main([*args, "--validate", bench([256, 1024])]) == 2
    assert "no [4096] token points" in capsys.readouterr().err
    assert main([*args, "--validate", bench([16, 256, 1024, 4096])]) == 0
    out = capsys.readouterr().out
    assert "worst at 256, 1,024 and 4,096 tokens: 50% (NOT within 25%)" in out
    assert "worst at every length: 50%" in out
    assert any(line.split()[:3] == ["host", "load", "16"] for line in out.splitlines())


def test_refit_fits_a_calibration_files_measurements_again(tmp_path, capsys):
    truth = Hardware("this machine", 400e9, 28e9, mfu=0.75, attn_fraction=0.55,
                     step_overhead_s=0.007, prefill_overhead_s=0.012, memory_overlap=False,
                     weight_dtype="float32", kv_dtype="float32", prefill_chunk=512,
                     tiers=(Tier("host", 1e-3, 4e9, "measured"),))  # fmt: skip
    roof = Roofline(SMOL, truth)
    measured = {
        "model": "default",
        "prefill_steps": [
            (q, c, roof.forward_s(q, c)) for q, c in [(64, 0), (512, 0), (512, 2048)]
        ],
        "decode_steps": [(c, roof.forward_s(1, c)) for c in (64, 2560)],
    }
    src, dst = tmp_path / "old.json", tmp_path / "new.json"
    save_machine(src, truth.replace(mfu=0.3, step_overhead_s=0.0, prefill_overhead_s=0.0), measured)
    assert main(["breakeven", "--calibrate", "--refit", str(src), "--machine", str(dst)]) == 0
    assert "refitted from" in capsys.readouterr().out
    refitted = load_machine(dst)
    assert refitted.mfu == pytest.approx(0.75, rel=1e-3)
    assert refitted.prefill_overhead_s == pytest.approx(0.012, rel=1e-3)
    assert refitted.tiers == truth.tiers
    assert main(["breakeven", "--calibrate", "--refit", str(tmp_path / "none.json")]) == 2

"""``kvwise breakeven --predict`` and ``--calibrate``: the command over ``roofline.py``'s
model — the break-even per tier, a table of TTFT by prefix length, a PNG, and the check of a
prediction against ``kvwise bench breakeven``'s measured curves. Pure Python (matplotlib for
the plot; ``--calibrate`` runs ``calibrate.py``)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvwise.core.kv_spec import kv_formats
from kvwise.perf.model_shape import GB, MODELS, WEIGHT_DTYPE_BYTES, ModelShape, model_shape
from kvwise.perf.roofline import (
    HARDWARE,
    THIS_MACHINE,
    TIERS,
    Hardware,
    Roofline,
    Tier,
    default_machine_file,
    hardware_preset,
    tiers_for,
)

REPORT_LENGTHS = (256, 1024, 4096, 16384, 131072)


def predict(
    model: ModelShape,
    hw: Hardware,
    tiers: list[Tier],
    overlap: bool,
    gpus: int,
    lengths=REPORT_LENGTHS,
    max_tokens: int = 1 << 20,
) -> dict:
    roof = Roofline(model, hw, overlap, gpus)
    out = {
        "model": model.name,
        "hardware": hw.name,
        "gpus": gpus,
        "overlap": overlap,
        "weight_bytes": roof.weight_bytes,
        "kv_bytes_per_token": roof.kv_per_token,
        "lengths": list(lengths),
        "recompute_s": [roof.recompute_s(n) for n in lengths],
        "tiers": {},
        "warnings": roof.warnings(),
    }
    for t in tiers:
        out["tiers"][t.name] = {
            "latency_s": t.latency_s,
            "bandwidth": t.bandwidth,
            "source": t.source,
            "load_s": [roof.load_s(n, t) for n in lengths],
            "break_even_tokens": roof.break_even(t, max_tokens),
        }
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.1f} s"


def report(result: dict, model: ModelShape, hw: Hardware) -> str:
    lines = [f"{model.name} on {hw.name}" + (f" x {result['gpus']}" if result["gpus"] > 1 else "")]
    lines.append(
        f"  model: {model.total_params / 1e9:.3g} B parameters ({model.source or 'given'})"
        f"; weights {result['weight_bytes'] / GB:.3g} GB in {hw.weight_dtype}; KV "
        f"{result['kv_bytes_per_token']:,.0f} B/token in {hw.kv_dtype}"
    )
    lines.append(
        f"  hardware: {hw.peak_flops / 1e12:,.4g} TFLOP/s peak, mfu {hw.mfu:.2f}, "
        f"attention {hw.attn_fraction or hw.mfu:.2f}, memory {hw.mem_bandwidth / GB:,.4g}"
        f" GB/s ({'overlapped with' if hw.memory_overlap else 'after'} compute), step "
        f"overhead {hw.step_overhead_s * 1e3:.3g} ms (+{hw.prefill_overhead_s * 1e3:.3g}"
        f" ms a prefill step), request overhead "
        f"{hw.request_overhead_s * 1e3:.3g} ms; {hw.source}"
    )
    for name, t in result["tiers"].items():
        lines.append(
            f"  tier {name}: {t['latency_s'] * 1e6:,.0f} us + bytes / "
            f"{t['bandwidth'] / GB:.3g} GB/s ({t['source']})"
        )
    for w in result["warnings"]:
        lines.append(f"  warning: {w}")
    head = f"  {'prefix':>8} {'recompute':>11}" + "".join(
        f" {n + ' load':>13}" for n in result["tiers"]
    )
    lines.append("predicted TTFT (prefix of n tokens + one computed token):")
    lines.append(head)
    for i, n in enumerate(result["lengths"]):
        row = f"  {n:>8,} {_ms(result['recompute_s'][i]):>11}"
        for t in result["tiers"].values():
            row += f" {_ms(t['load_s'][i]):>13}"
        lines.append(row)
    for name, t in result["tiers"].items():
        be = t["break_even_tokens"]
        where = "never (recomputing wins at every length)" if be is None else f"{be:,} tokens"
        lines.append(f"break-even, {name}: {where}")
    return "\n".join(lines)


def plot(
    path: str,
    model: ModelShape,
    hw: Hardware,
    tiers: list[Tier],
    overlap: bool,
    gpus: int,
    measured: dict | None = None,
    max_tokens: int = 131072,
) -> None:
    """TTFT against prefix length per tier, break-evens marked; measured medians as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof = Roofline(model, hw, overlap, gpus)
    xs = sorted({int(round(2 ** (k / 8))) for k in range(0, 8 * int(math.log2(max_tokens)) + 1)})
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(xs, [roof.recompute_s(n) * 1e3 for n in xs], "k-", label="recompute (predicted)")
    colours = ["tab:green", "tab:blue", "tab:red", "tab:purple", "tab:orange", "tab:brown"]
    for i, t in enumerate(tiers):
        c = colours[i % len(colours)]
        be = roof.break_even(t, max_tokens)
        where = "never" if be is None else f"{be:,}"
        ax.plot(
            xs,
            [roof.load_s(n, t) * 1e3 for n in xs],
            "-",
            color=c,
            label=f"{t.name} load (predicted); break-even {where}",
        )
        if be:
            ax.axvline(be, color=c, ls=":", lw=1)
    if measured:
        lengths = measured["lengths"]
        med = measured["median_ttft_s"]
        ax.plot(lengths, [s * 1e3 for s in med["recompute"]], "ko", label="recompute (measured)")
        for i, t in enumerate(tiers):
            key = f"{t.name} load"
            if key in med:
                ax.plot(
                    lengths,
                    [s * 1e3 for s in med[key]],
                    "s",
                    color=colours[i % 6],
                    label=f"{t.name} load (measured)",
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"predicted TTFT: {model.name} on {hw.name}" + (f" x {gpus}" if gpus > 1 else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


ACCEPTANCE_LENGTHS = (256, 1024, 4096)


def validate(roof: Roofline, tiers: list[Tier], measured: dict) -> list[dict]:
    """Predicted vs measured median TTFT at every measured length: one row per (curve,
    length). The measured file must hold ``ACCEPTANCE_LENGTHS``."""
    med, have = measured["median_ttft_s"], measured["lengths"]
    missing = [n for n in ACCEPTANCE_LENGTHS if n not in have]
    if missing:
        raise ValueError(f"validate: the measured file has no {missing} token points ({have})")
    rows = []
    for i, n in enumerate(have):
        curves = [("recompute", roof.recompute_s(n), med["recompute"][i])]
        curves += [
            (f"{t.name} load", roof.load_s(n, t), med[f"{t.name} load"][i])
            for t in tiers
            if f"{t.name} load" in med
        ]
        for name, pred, meas in curves:
            rows.append(
                {
                    "curve": name,
                    "tokens": n,
                    "predicted_s": pred,
                    "measured_s": meas,
                    "error": pred / meas - 1,
                }
            )
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--predict",
        action="store_true",
        help="predict TTFT vs prefix length and the break-even per tier",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (matmul peak, memory bandwidth, prefill steps, "
        "each tier's reads) into --machine, for --hardware this-machine",
    )
    p.add_argument(
        "--hardware", default="h100-sxm", help=f"preset: {', '.join([*HARDWARE, THIS_MACHINE])}"
    )
    p.add_argument(
        "--model",
        default="default",
        help=f"preset ({', '.join(['default', *MODELS])}) or a GGUF / HF path",
    )
    p.add_argument(
        "--tiers",
        default=None,
        help=f"comma-separated tiers: presets ({', '.join(TIERS)}), NAME=LATENCY_MS:"
        "GB_PER_S, or this machine's measured host, disk, redis (default: the "
        "hardware's)",
    )
    p.add_argument("--mfu", type=float, default=None, help="fraction of peak for the matmuls")
    p.add_argument(
        "--attn-fraction",
        type=float,
        default=None,
        help="fraction of peak for attention (default: --mfu)",
    )
    p.add_argument("--weight-dtype", default=None, choices=sorted(WEIGHT_DTYPE_BYTES))
    p.add_argument("--kv-dtype", default=None, choices=kv_formats("size"))
    p.add_argument("--gpus", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="loads stream layer by layer under the forward (default: load, then "
        "compute, as kvwise's default of one layer group does)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=1 << 20,
        help="search the break-even up to this many tokens",
    )
    p.add_argument(
        "--machine",
        default=None,
        help=f"this machine's calibration file (default {default_machine_file()})",
    )
    p.add_argument(
        "--validate",
        default=None,
        metavar="BENCH_JSON",
        help="`kvwise bench breakeven --out` results: predicted vs measured at 256, "
        "1,024 and 4,096 tokens",
    )
    p.add_argument("--reps", type=int, default=5, help="--calibrate: repetitions per point")
    p.add_argument(
        "--refit",
        default=None,
        metavar="CALIBRATION_JSON",
        help="with --calibrate: fit that file's measurements again with this "
        "version's model, into --machine (nothing is measured)",
    )
    p.add_argument("--plot", default=None, help="write TTFT vs prefix length as a PNG here")
    p.add_argument("--out", default=None, help="write the prediction as JSON here")


def main(args: argparse.Namespace) -> int:
    if args.calibrate:
        machine = Path(args.machine) if args.machine else default_machine_file()
        if args.refit:
            from kvwise.perf.calibrate import print_fit
            from kvwise.perf.roofline_fit import refit_machine

            hw, check = refit_machine(args.refit, machine)
            print_fit(hw, check)
            print(f"calibration: {machine} (refitted from {args.refit})")
            return 0
        from kvwise.perf.calibrate import calibrate

        calibrate(args, machine)
        return 0
    if not args.predict:
        raise ValueError(
            "breakeven: give --predict (a model) or --calibrate (measure this "
            "machine); `kvwise bench breakeven` measures the real curves"
        )
    model = model_shape(args.model)
    hw = hardware_preset(args.hardware, args.machine)
    changes = {
        k: v
        for k, v in (
            ("mfu", args.mfu),
            ("attn_fraction", args.attn_fraction),
            ("weight_dtype", args.weight_dtype),
            ("kv_dtype", args.kv_dtype),
        )
        if v is not None
    }
    hw = hw.replace(**changes) if changes else hw
    tiers = tiers_for(hw, [t for t in args.tiers.split(",") if t] if args.tiers else None)
    if args.max_tokens < 2:
        raise ValueError(f"max_tokens: expected at least 2, got {args.max_tokens}")
    lengths = [n for n in REPORT_LENGTHS if n <= args.max_tokens] or [args.max_tokens]
    result = predict(model, hw, tiers, args.overlap, args.gpus, lengths, args.max_tokens)
    print(report(result, model, hw))
    measured = None
    if args.validate:
        measured = json.loads(Path(args.validate).read_text())
        roof = Roofline(model, hw, args.overlap, args.gpus)
        rows = validate(roof, tiers, measured)
        result["validation"] = rows
        print(f"\npredicted vs measured ({args.validate}):")
        print(f"  {'curve':<14} {'tokens':>7} {'predicted':>11} {'measured':>11} {'error':>7}")
        for r in rows:
            print(
                f"  {r['curve']:<14} {r['tokens']:>7,} {_ms(r['predicted_s']):>11} "
                f"{_ms(r['measured_s']):>11} {r['error']:>+7.0%}"
            )
        worst = max(abs(r["error"]) for r in rows if r["tokens"] in ACCEPTANCE_LENGTHS)
        print(
            f"  worst at 256, 1,024 and 4,096 tokens: {worst:.0%} "
            f"({'within' if worst <= 0.25 else 'NOT within'} 25%)"
        )
        if any(r["tokens"] not in ACCEPTANCE_LENGTHS for r in rows):
            print(f"  worst at every length: {max(abs(r['error']) for r in rows):.0%}")
    if args.plot:
        plot(
            args.plot,
            model,
            hw,
            tiers,
            args.overlap,
            args.gpus,
            measured,
            max_tokens=min(args.max_tokens, 131072),
        )
        print(f"plot: {args.plot}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0

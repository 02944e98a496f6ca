"""Fitting ``roofline.py``'s model to this machine's measurements (``kvwise breakeven
--calibrate``, ``calibrate.py``, measures them): the step overheads and fractions
of peak from the engine's own prefill and decode steps, a tier's latency and bandwidth from
its loads, and ``--refit`` of a calibration file. Pure Python."""

from __future__ import annotations

import json
from pathlib import Path

from kvwise.perf.model_shape import ModelShape, model_shape
from kvwise.perf.roofline import Hardware, Roofline, Tier, load_machine, save_machine


def least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Ordinary least squares by the normal equations (a handful of features)."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            raise ValueError("calibration: the measurements cannot separate the model's terms")
        a[col], a[piv], b[col], b[piv] = a[piv], a[col], b[piv], b[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(k)]


def fit_steps(model: ModelShape, hw: Hardware, prefill: list, decode: list) -> Hardware:
    """``hw`` with its per-step overhead and fractions of peak fitted to measured steps, under
    whichever of the two step forms fits them better (smaller worst relative error over every
    step, to 0.5%; then the smaller prefill overhead, the less left unexplained): compute and
    memory overlapped (the roofline's max) or one after the other (their sum).

    Decode steps ``(context, seconds)`` give the per-step overhead: their excess over the
    one-token forward (median). Prefill steps ``(q, c, seconds)``, less that overhead (and,
    for the sum, their memory time), give the rest: least squares of ``prefill overhead +
    linear FLOPs/(mfu·peak) + attention FLOPs/(af·peak)``, each step weighted by 1/its time so
    short steps count as much as long ones. The overhead and the rest are refitted in turn."""
    best = None
    for overlap in (True, False):
        fitted = hw.replace(memory_overlap=overlap)
        for _ in range(3):
            fitted = _fit_fractions(model, _fit_overhead(model, fitted, decode), prefill)
        roof = Roofline(model, fitted)
        errors = [roof.forward_s(q, c) / s - 1 for q, c, s in prefill]
        errors += [roof.forward_s(1, c) / s - 1 for c, s in decode]
        rank = (round(max(map(abs, errors)) * 200) / 200, fitted.prefill_overhead_s)
        if best is None or rank < best[0]:
            best = (rank, fitted)
    return best[1]


def _fit_overhead(model: ModelShape, hw: Hardware, decode: list) -> Hardware:
    roof = Roofline(model, hw.replace(step_overhead_s=0.0))
    excess = sorted(s - roof.forward_s(1, c) for c, s in decode)
    return hw.replace(step_overhead_s=max(0.0, excess[len(excess) // 2]) if excess else 0.0)


def _fit_fractions(model: ModelShape, hw: Hardware, prefill: list) -> Hardware:
    roof = Roofline(model, hw)
    rows, ys = [], []
    for q, c, s in prefill:
        rest = s - hw.step_overhead_s - (0.0 if hw.memory_overlap else roof.memory_s(q, c))
        rows.append(
            [
                1 / s,
                model.linear_flops(q) / hw.peak_flops / s,
                model.attention_flops(q, c) / hw.peak_flops / s,
            ]
        )
        ys.append(rest / s)
    extra, inv_mfu, inv_af = least_squares(rows, ys)
    if inv_mfu <= 0 or inv_af <= 0:
        raise ValueError(
            f"calibration: fitted fractions of peak are not positive "
            f"(1/mfu {inv_mfu:.3g}, 1/attn {inv_af:.3g})"
        )
    return hw.replace(
        prefill_overhead_s=max(0.0, extra),
        mfu=min(1.0, 1 / inv_mfu),
        attn_fraction=min(1.0, 1 / inv_af),
    )


def step_check(model: ModelShape, hw: Hardware, prefill: list, decode: list) -> list[dict]:
    """Each calibration step, measured and as fitted."""
    roof = Roofline(model, hw)
    rows = [(q, c, s) for q, c, s in prefill] + [(1, c, s) for c, s in decode]
    return [
        {"tokens": q, "context": c, "measured_s": s, "predicted_s": roof.forward_s(q, c)}
        for q, c, s in rows
    ]


def refit_machine(src: str | Path, dst: str | Path) -> tuple[Hardware, list[dict]]:
    """Fit a calibration file's measured steps again, with this version's model (tiers,
    peak and bandwidth as measured); write the result to ``dst``."""
    hw = load_machine(src)
    measured = json.loads(Path(src).read_text())["measured"]
    model = model_shape(measured.get("model", "default"))
    draft = hw.replace(step_overhead_s=0.0, prefill_overhead_s=0.0)
    hw = fit_steps(model, draft, measured["prefill_steps"], measured["decode_steps"])
    check = step_check(model, hw, measured["prefill_steps"], measured["decode_steps"])
    save_machine(dst, hw, {**measured, "step_check": check, "refitted_from": str(src)})
    return hw, check


def fit_tier(name: str, reads: list[tuple[float, float]], source: str) -> Tier:
    """From measured reads ``(bytes, seconds)``: latency + bytes / bandwidth."""
    lat, s_per_byte = least_squares([[1.0, b] for b, _ in reads], [s for _, s in reads])
    if s_per_byte <= 0:
        raise ValueError(f"calibration: tier {name}'s reads do not grow with their size")
    return Tier(name, max(lat, 0.0), 1 / s_per_byte, source)

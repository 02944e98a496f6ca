"""A roofline model of TTFT against prefix length, recompute vs a load from each tier, for
hardware one does not own (``kvwise breakeven --predict``, ``predict.py``). Pure Python.

A prefix of ``n`` tokens followed by one computed token, as ``kvwise bench breakeven`` measures:

- **recompute**: prefill the ``n + 1`` tokens, in chunks of the engine's prefill chunk size.
- **load from a tier**: the tier's fixed latency + the prefix's KV bytes / the tier's bandwidth,
  then one forward of the last token over the ``n`` loaded ones (or, with ``overlap``, the read
  streamed layer by layer under that forward).

One forward of ``q`` new tokens over ``c`` cached ones is a roofline: the longer of its compute
time and its memory time, plus a fixed per-step overhead:

- compute: ``2·P·q`` FLOPs for the weights' matmuls (``P`` the linear layers' parameters) plus
  one token's LM head ``2·hidden·vocab``, at ``mfu`` × peak; attention's scores and weighted
  sum ``4·layers·heads·head_dim·q·(c + (q + 1)/2)`` (causal) at ``attn_fraction`` × peak;
- memory: every weight read once plus the KV of ``c + q`` tokens, over the memory bandwidth.

The break-even is the shortest prefix from which loading beats recomputing (bisection on the
first sign change of a log-spaced scan); None when loading never wins up to ``max_tokens``.

The model side (its parameters, FLOPs and KV bytes, the presets) is ``model_shape.py``.
Hardware presets carry their datasheet sources; where a figure is an assumption (the fraction
of peak a prefill reaches, a network's round trip) the preset says so. ``this-machine`` is not
a preset: ``kvwise breakeven --calibrate`` measures it (``calibrate.py``) and
fits this model to the measurements (``roofline_fit.py``) into a calibration file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvwise.core.kv_spec import kv_formats
from kvwise.perf.model_shape import GB, WEIGHT_DTYPE_BYTES, ModelShape


@dataclass(frozen=True)
class Tier:
    """A place KV is loaded from: ``latency_s + bytes / bandwidth``."""

    name: str
    latency_s: float
    bandwidth: float  # bytes per second
    source: str = ""

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"tier {self.name}: latency must be >= 0 s, got {self.latency_s}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"tier {self.name}: bandwidth must be > 0, got {self.bandwidth}")

    def load_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    """An accelerator (or CPU) and the defaults its users run it with."""

    name: str
    peak_flops: float  # dense, in the dtype the model computes in
    mem_bandwidth: float  # bytes per second
    memory_bytes: float | None = None
    mfu: float = 0.5  # fraction of peak the weights' matmuls reach in prefill (assumed)
    attn_fraction: float | None = None  # the same for attention (None: mfu)
    step_overhead_s: float = 0.0  # per forward: launches, scheduling
    prefill_overhead_s: float = 0.0  # more per forward of more than one token (masks, paths)
    memory_overlap: bool = True  # a step takes max(compute, memory) (the roofline); else sum
    request_overhead_s: float = 0.0  # per request, outside the forwards
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "float16"
    prefill_chunk: int | None = None  # tokens per prefill step (None: the whole prompt)
    tiers: tuple[Tier, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("peak_flops", "mem_bandwidth"):
            value = getattr(self, f)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{f}: expected a positive number, got {value!r}")
        for f in ("mfu", "attn_fraction"):
            value = getattr(self, f)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{f}: expected a fraction of peak in (0, 1], got {value!r}")
        for f in ("step_overhead_s", "prefill_overhead_s", "request_overhead_s"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"{f}: expected >= 0 s, got {getattr(self, f)!r}")
        if self.weight_dtype not in WEIGHT_DTYPE_BYTES:
            raise ValueError(
                f"weight_dtype: expected one of {sorted(WEIGHT_DTYPE_BYTES)}, got "
                f"{self.weight_dtype!r}"
            )
        if self.kv_dtype not in kv_formats("size"):
            raise ValueError(
                f"kv_dtype: expected one of {kv_formats('size')}, got {self.kv_dtype!r}"
            )
        if self.prefill_chunk is not None and self.prefill_chunk <= 0:
            raise ValueError(
                f"prefill_chunk: expected a positive number of tokens, got {self.prefill_chunk!r}"
            )

    def replace(self, **changes) -> Hardware:
        return dataclasses.replace(self, **changes)


# ---- presets: datasheet figures (dense, no sparsity), with where they come from ------------

_PCIE5 = Tier(
    "host",
    10e-6,
    63e9,
    "host RAM over PCIe Gen5 x16: 32 GT/s x 16 lanes, "
    "128b/130b = 63 GB/s each way (PCI-SIG); latency ~10 us assumed",
)
_PCIE4 = Tier(
    "host",
    10e-6,
    31.5e9,
    "host RAM over PCIe Gen4 x16: 16 GT/s x 16 lanes = "
    "31.5 GB/s each way (PCI-SIG); latency ~10 us assumed",
)
TIERS = {
    "host-pcie5": _PCIE5,
    "host-pcie4": _PCIE4,
    "nvme-gen4": Tier(
        "nvme",
        100e-6,
        7.0e9,
        "one PCIe Gen4 x4 NVMe SSD: ~7 GB/s sequential "
        "read (e.g. Samsung 990 PRO datasheet 7,450 MB/s); ~100 us read latency "
        "(flash, assumed)",
    ),
    "nvme-gen5": Tier(
        "nvme",
        100e-6,
        14.0e9,
        "one PCIe Gen5 x4 NVMe SSD: ~14 GB/s sequential "
        "read (e.g. Crucial T705 datasheet 14,500 MB/s); ~100 us (assumed)",
    ),
    "net-25g": Tier(
        "net-25g",
        200e-6,
        25e9 / 8,
        "25 Gb/s Ethernet line rate = 3.1 GB/s; "
        "200 us round trip to a cache server in the rack (assumed)",
    ),
    "net-100g": Tier(
        "net-100g", 100e-6, 100e9 / 8, "100 Gb/s line rate = 12.5 GB/s; 100 us round trip (assumed)"
    ),
    "net-400g": Tier(
        "net-400g",
        50e-6,
        400e9 / 8,
        "400 Gb/s (e.g. NDR InfiniBand) line rate = 50 GB/s; 50 us round trip with RDMA (assumed)",
    ),
}
_MFU_NOTE = (
    "mfu 0.5 assumed (well-tuned prefill reaches roughly 40-60% of dense peak); --mfu changes it"
)
HARDWARE = {
    "h100-sxm": Hardware(
        "H100 SXM",
        989e12,
        3.35e12,
        80e9,
        tiers=(_PCIE5, TIERS["nvme-gen4"]),
        source="NVIDIA H100 datasheet: BF16 1,979 TFLOP/s with sparsity = 989 "
        f"dense; 80 GB HBM3 at 3.35 TB/s; host link PCIe Gen5 x16. {_MFU_NOTE}",
    ),
    "h200": Hardware(
        "H200 SXM",
        989e12,
        4.8e12,
        141e9,
        tiers=(_PCIE5, TIERS["nvme-gen4"]),
        source="NVIDIA H200 datasheet: BF16 1,979 TFLOP/s with sparsity = 989 "
        f"dense; 141 GB HBM3e at 4.8 TB/s; PCIe Gen5 x16. {_MFU_NOTE}",
    ),
    "a100-sxm": Hardware(
        "A100 SXM 80GB",
        312e12,
        2.039e12,
        80e9,
        tiers=(_PCIE4, TIERS["nvme-gen4"]),
        source="NVIDIA A100 datasheet: BF16 312 TFLOP/s dense; 80 GB HBM2e at "
        f"2,039 GB/s; PCIe Gen4 x16. {_MFU_NOTE}",
    ),
    "l4": Hardware(
        "L4",
        121e12,
        300e9,
        24e9,
        tiers=(_PCIE4, TIERS["nvme-gen4"]),
        source="NVIDIA L4 datasheet: BF16 242 TFLOP/s with sparsity = 121 dense; "
        f"24 GB GDDR6 at 300 GB/s; PCIe Gen4 x16. {_MFU_NOTE}",
    ),
}
THIS_MACHINE = "this-machine"


def hardware_preset(name: str, machine_file: str | Path | None = None) -> Hardware:
    if name == THIS_MACHINE:
        return load_machine(machine_file or default_machine_file())
    if name not in HARDWARE:
        raise ValueError(
            f"hardware: unknown preset {name!r}; presets: {', '.join([*HARDWARE, THIS_MACHINE])}"
        )
    return HARDWARE[name]


def parse_tier(text: str) -> Tier:
    """A preset name, or ``NAME=LATENCY_MS:GB_PER_S`` (e.g. ``remote=0.5:10``)."""
    if text in TIERS:
        return TIERS[text]
    name, sep, spec = text.partition("=")
    lat, sep2, bw = spec.partition(":")
    try:
        if not (sep and sep2 and name):
            raise ValueError
        return Tier(name, float(lat) / 1e3, float(bw) * GB, "given on the command line")
    except ValueError as e:
        detail = f" ({e})" if str(e) else ""
        raise ValueError(
            f"tier: unknown preset or bad spec {text!r}{detail}; presets: "
            f"{', '.join(TIERS)}, or NAME=LATENCY_MS:GB_PER_S"
        ) from None


# ---- the model --------------------------------------------------------------------------


class Roofline:
    """TTFT of recompute and of each tier's load, for one model on one machine."""

    def __init__(self, model: ModelShape, hw: Hardware, overlap: bool = False, gpus: int = 1):
        if gpus < 1:
            raise ValueError(f"gpus: expected at least 1, got {gpus}")
        self.model, self.hw, self.overlap, self.gpus = model, hw, overlap, gpus
        self.weight_bytes = model.total_params * WEIGHT_DTYPE_BYTES[hw.weight_dtype]
        self.kv_per_token = model.kv_bytes_per_token(hw.kv_dtype)
        self._peak = hw.peak_flops * gpus  # tensor parallel: compute and memory split evenly
        self._mem_bw = hw.mem_bandwidth * gpus

    def warnings(self) -> list[str]:
        out = []
        capacity = (self.hw.memory_bytes or 0) * self.gpus
        if capacity and self.weight_bytes > 0.9 * capacity:
            out.append(
                f"the weights ({self.weight_bytes / GB:.0f} GB in {self.hw.weight_dtype}) do not "
                f"fit {self.gpus} x {self.hw.memory_bytes / GB:.0f} GB: pass --gpus (tensor "
                "parallel, communication not modelled)"
            )
        return out

    def forward_s(self, q: int, c: int) -> float:
        """One forward of ``q`` new tokens after ``c`` cached ones."""
        hw, m = self.hw, self.model
        compute = m.linear_flops(q) / (hw.mfu * self._peak) + m.attention_flops(q, c) / (
            (hw.attn_fraction or hw.mfu) * self._peak
        )
        memory = self.memory_s(q, c)
        both = max(compute, memory) if hw.memory_overlap else compute + memory
        return hw.step_overhead_s + (hw.prefill_overhead_s if q > 1 else 0.0) + both

    def memory_s(self, q: int, c: int) -> float:
        """A forward's memory time: every weight and the KV of ``c + q`` tokens read once."""
        return (self.weight_bytes + self.kv_per_token * (c + q)) / self._mem_bw

    def recompute_s(self, n: int) -> float:
        """TTFT: prefill the prefix of ``n`` tokens and one more, chunk by chunk."""
        total, size = n + 1, self.hw.prefill_chunk or n + 1
        return self.hw.request_overhead_s + sum(
            self.forward_s(min(size, total - s), s) for s in range(0, total, size)
        )

    def load_s(self, n: int, tier: Tier) -> float:
        """TTFT: read the prefix's KV from ``tier``, then the last token's forward."""
        read = tier.load_s(n * self.kv_per_token)
        forward = self.forward_s(1, n)
        if self.overlap:  # streamed layer by layer: the slower of the two, plus one layer
            layers = self.model.num_layers
            busy = (
                max(read - tier.latency_s, forward) + min(read - tier.latency_s, forward) / layers
            )
            return self.hw.request_overhead_s + tier.latency_s + busy
        return self.hw.request_overhead_s + read + forward

    def break_even(self, tier: Tier, max_tokens: int = 1 << 20) -> int | None:
        """The shortest prefix loading ``tier`` beats recomputing; None up to ``max_tokens``."""

        def wins(n: int) -> bool:
            return self.load_s(n, tier) < self.recompute_s(n)

        if wins(1):
            return 1
        lo, n = 1, 2
        while True:
            n = min(n, max_tokens)
            if wins(n):
                while n - lo > 1:  # bisect: lo loses, n wins
                    mid = (lo + n) // 2
                    lo, n = (lo, mid) if wins(mid) else (mid, n)
                return n
            if n == max_tokens:
                return None
            lo, n = n, 2 * n


def tiers_for(hw: Hardware, names: list[str] | None) -> list[Tier]:
    if not names:
        if not hw.tiers:
            raise ValueError("tiers: this hardware has no default tiers; pass --tiers")
        return list(hw.tiers)
    measured = {t.name: t for t in hw.tiers}
    return [measured[n] if n in measured else parse_tier(n) for n in names]


# ---- this machine, as measured ------------------------------------------------------------


def default_machine_file() -> Path:
    return Path.home() / ".cache" / "kvwise" / "this_machine.json"


def save_machine(path: str | Path, hw: Hardware, measured: dict) -> None:
    """Write a calibration: the hardware as fitted and what it was fitted from."""
    data = dataclasses.asdict(hw)
    data["tiers"] = [dataclasses.asdict(t) for t in hw.tiers]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"hardware": data, "measured": measured}, indent=2))


def load_machine(path: str | Path) -> Hardware:
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"machine: no calibration at '{p}': run `kvwise breakeven --calibrate "
            f"--machine {p}` first (about two minutes)"
        )
    try:
        data = json.loads(p.read_text())["hardware"]
        tiers = tuple(Tier(**t) for t in data.pop("tiers"))
        return Hardware(**data, tiers=tiers)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"machine: '{p}' is not a calibration file ({e})") from None

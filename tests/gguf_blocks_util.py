"""Random but valid raw GGUF blocks of every type kvwise runs natively, for tests.

Random bytes make valid blocks of these types once their float16 fields hold sane values; the
weights then come out in the range of real checkpoints' (|w| up to ~0.3)."""

from __future__ import annotations

import gguf
import numpy as np

# byte offsets of each type's float16 fields within a block (ggml-common.h's block structs)
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2],
    "Q5_K": [0, 2], "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82],
}  # fmt: skip
# a scale's largest integer factor (the codes' and the sub-block scales' product), per type
_RANGE = {"Q4_0": 8, "Q4_1": 15, "Q8_0": 127, "Q5_0": 16, "Q5_1": 31, "Q4_K": 945,
          "Q5_K": 1953, "Q6_K": 4096, "Q3_K": 128, "Q2_K": 45}  # fmt: skip


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """`(rows, row bytes)` uint8: a `(rows, cols)` tensor of type ``name`` in raw blocks."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if name == "MXFP4":  # a power-of-two scale byte: 2^-12 .. 2^-6, |w| up to 0.19
        raw[:, 0] = rng.integers(116, 123, n, dtype=np.uint8)
    for at in F16_FIELDS.get(name, ()):
        d = rng.uniform(0.05, 0.3, n) / _RANGE[name]
        raw[:, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)

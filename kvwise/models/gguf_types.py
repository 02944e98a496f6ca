"""What each GGUF tensor type runs as under ``quantization="auto"``, and what it then costs in
memory. No torch: ``kvwise size`` answers from a file's tensor list alone.

The rule (``runs_as``; ``gguf_load.py`` builds the weights by it): Q4_0 / Q4_1 linear weights
run as kvwise's int4 blocks, Q8_0 as int8 blocks, Q5_0, Q5_1, Q2_K .. Q6_K and MXFP4 as their
own blocks (``gguf_blocks.BlockWeight``), F32 / F16 / BF16 as float32 — all exactly; an embedding
or LM head of Q4_0 / Q4_1 as int8 blocks (above its precision: the head's refinement needs
exact rows); every other type converted to int8 blocks where it has fewer bits a weight than
their 8.5, else to float32. Never below the file's precision; F64 and integer tensors are
refused. ``RESIDENT_BITS``: bits a weight of each format as it is held (the kernels' layouts,
their float16 / int8 scale fields included).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import gguf

FLOATS = ("F32", "F16", "BF16")
REFUSED = ("F64", "I8", "I16", "I32", "I64")
NATIVE_BLOCKS = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "MXFP4")  # gguf_blocks
_Q8_BITS = 8.5  # int8 blocks of 32 with a float16 scale
RESIDENT_BITS = {
    "int4": 5.0,
    "Q8_0": 8.5,
    "float32": 32.0,
    "Q5_0": 5.5,
    "Q5_1": 6.0,
    "Q4_K": 4.625,
    "Q5_K": 5.625,
    "Q6_K": 6.5625,
    "Q3_K": 4.5625,
    "Q2_K": 5.125,
    "MXFP4": 4.25,
}


def bits_per_weight(gguf_type: str) -> float:
    """The file's bits a weight of ``gguf_type``."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]]
    return 8 * size / block


def runs_as(gguf_type: str, head: bool = False) -> str:
    """ "FORMAT (exact)" or "FORMAT (converted)": what a tensor of ``gguf_type`` runs as
    (``head``: the embedding or the LM head).

    Raises:
        ValueError: an integer or float64 tensor (no format here holds it without loss).
    """
    if gguf_type in REFUSED:
        raise ValueError(
            f"weights: {gguf_type} tensors are not supported (float64 would run "
            f"below its precision, integers are no weights); convert the file to F32"
        )
    if gguf_type in FLOATS:
        return "float32 (exact)"
    if gguf_type in ("Q4_0", "Q4_1"):
        return "Q8_0 (converted)" if head else "int4 (exact)"
    if gguf_type == "Q8_0" or gguf_type in NATIVE_BLOCKS:
        return f"{gguf_type} (exact)"
    return "Q8_0 (converted)" if bits_per_weight(gguf_type) < _Q8_BITS else "float32 (converted)"


def resident_bytes(
    tensors: Iterable[tuple[str, str, int]], tied: bool, heads: tuple[int, int] | None = None
) -> Counter:
    """``{(gguf type, runs as): bytes}`` of a file's weights as ``auto`` holds them, from
    ``(name, gguf type, elements)`` of each tensor (GGUF names); a tied head counts once.
    ``heads`` (query, KV heads): a q / k norm (one head's weights in the file) held once a
    head, as the decoder's fused ``qk_norm`` holds it."""
    total: Counter = Counter()
    for name, gguf_type, elements in tensors:
        if name == "output.weight" and tied:
            continue
        if heads is not None and name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            elements *= heads[0] if name.endswith("attn_q_norm.weight") else heads[1]
        head = name in ("token_embd.weight", "output.weight")
        how = runs_as(gguf_type, head) if gguf_type not in FLOATS else "float32 (exact)"
        total[gguf_type, how] += round(elements * RESIDENT_BITS[how.split()[0]] / 8)
    return total

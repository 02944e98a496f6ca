"""A mixture of experts' weights of one projection held as one tensor, for ``qkmm_experts``.

Every expert's gate/up (or down) weight of a GGUF layer has one block type (llama.cpp stacks
them in one tensor), so their packed layouts (``gguf_blocks.BlockWeight``) stack into one
``(E, N / 8, blocks, bytes)`` tensor, and the kernel runs each expert's rows of a step against
its weight in one pass (``kernels/csrc/kquant.cpp``): the step's activations quantized once,
the work split over (expert, column pair) across the threads, instead of two ``qkmm`` calls an
expert. A row's arithmetic is ``qkmm``'s, so the results are the per-expert calls' bits.

A gate/up of two types (a ``ConcatWeight``: gate and up side by side) is a stack per part, their
outputs side by side as ``ConcatWeight.mm`` puts them. Experts in other formats (int4, int8
blocks, float) have no stack: ``stack_experts`` answers None and the experts run one by one.
"""

from __future__ import annotations

import torch

from kvwise import kernels
from kvwise.models.gguf_blocks import BlockSpec, BlockWeight, ConcatWeight


class ExpertStack:
    """One projection of every expert: a stack of packed block weights per part (see above)."""

    def __init__(self, parts: list[tuple[BlockSpec, torch.Tensor, int]], in_features: int):
        self.parts = parts  # (spec, packed (E, G, blocks, bytes), out features)
        self.in_features = in_features
        self.out_features = sum(out for _, _, out in parts)

    def mm(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``x`` ``(M, in)`` rows grouped by expert (expert e's: ``offsets[e] .. offsets[e +
        1]``) -> ``(M, out)`` float32, each row times its expert's weight."""
        x = x.float().contiguous()
        outs = [
            torch.ops.kvwise.qkmm_experts(x, offsets, packed, spec.kind)[:, :out]
            for spec, packed, out in self.parts
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def expert(self, e: int) -> BlockWeight | ConcatWeight:
        """Expert ``e``'s weight, a view of the stack (no copy)."""
        parts = [
            BlockWeight(spec, packed[e], out, self.in_features) for spec, packed, out in self.parts
        ]
        return parts[0] if len(parts) == 1 else ConcatWeight(parts)


def _parts(weight) -> list[BlockWeight] | None:
    parts = weight.parts if isinstance(weight, ConcatWeight) else [weight]
    return parts if all(type(p) is BlockWeight for p in parts) else None


def stack_experts(weights: list) -> ExpertStack | None:
    """The experts' weights of one projection as one stack, or None where they are not all
    block weights of the same types and shapes (or the kernels are not built)."""
    if not kernels.available():
        return None
    split = [_parts(w) for w in weights]
    first = split[0]
    if first is None or any(
        s is None
        or len(s) != len(first)
        or any(
            (p.spec, p.packed.shape, p.out_features) != (f.spec, f.packed.shape, f.out_features)
            for p, f in zip(s, first, strict=True)
        )
        for s in split
    ):
        return None
    parts = [
        (f.spec, torch.stack([s[i].packed for s in split]), f.out_features)
        for i, f in enumerate(first)
    ]
    return ExpertStack(parts, weights[0].in_features)

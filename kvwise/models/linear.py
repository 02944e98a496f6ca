"""The one interface of a linear weight, the float one, and the LM heads.

A decoder layer's four linear weights (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) are each a ``Linear``: ``FloatWeight`` (a float ``[in, out]`` parameter of the
layer), or ``Int8Weight`` / ``Int4Weight`` (``models/quant.py``). The step's plain
composition (``layer_ops.TorchLayerOps``) calls only ``mm``; the fused ops read the
quantized weights' packed bytes.

The LM head is a ``FloatHead`` or, on quantized weights, a ``RefinedHead``: the int8-block
matmul, then the top ``EXACT_TOP_K`` logits of each row recomputed in float32 from the exact
rows, so greedy picks and the head of the distribution are as precise as the float path's.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvwise import kernels

# the logits recomputed in float32 after the quantized LM head (per row)
EXACT_TOP_K = 64


def param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """An uninitialized parameter (filled by a loader)."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _FusedOps:
    """The kernels' overloads, looked up once (``torch.ops`` attribute access per call costs)."""

    def __getattr__(self, name: str):
        op = getattr(torch.ops.kvwise, name).default
        setattr(self, name, op)
        return op


FUSED = _FusedOps()


class Linear(Protocol):
    """A linear weight `(out, in)` applied to rows: ``mm(x)`` is `x @ W.T`."""

    out_features: int
    in_features: int

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(T, in)` -> `(T, out)`, in the weight's output dtype."""
        ...

    def dequantize(self) -> torch.Tensor:
        """The float `(out, in)` weight it computes with."""
        ...


def float_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for float weights: float32 on kvwise's ``f32mm`` where the kernels are built
    (each output one fma chain down k: a row's bits do not depend on the other rows, where a
    BLAS picks other kernels for other row counts), else ``torch.mm``."""
    if w.dtype == torch.float32 and x.dtype == torch.float32 and kernels.runs_on(x):
        return FUSED.f32mm(x, w)
    return torch.mm(x, w)


class FloatWeight:
    """A float weight held transposed, ``[in, out]`` contiguous (a parameter of the layer,
    or a view of one: it is filled in place), applied as ``x @ w``. Its bytes are counted with
    the model's parameters."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [in, out]
        self.in_features, self.out_features = weight.shape

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return float_mm(x, self.weight)  # (T, out) in the weight's dtype

    def dequantize(self) -> torch.Tensor:
        return self.weight.t().float()


class FloatHead:
    """The LM head on a float ``[hidden, vocab]`` weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def logits(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """`(N, hidden)` -> `(N, vocab)` float32 (exact: ``bitmask`` changes nothing)."""
        return float_mm(hidden, self.weight).float()


class HeadWeight(Linear, Protocol):
    """A quantized embedding / LM head (``Q8Weight``, ``gguf_blocks.BlockWeight``): a linear
    weight whose rows it can also give exactly."""

    nbytes: int

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) as float32 `(*ids.shape, in)`, exact."""
        ...

    def dot_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`x` `(N, in)`, `ids` `(N, k)` -> `(N, k)` float32: x[n] . row ids[n][i]."""
        ...


class RefinedHead:
    """The LM head on quantized blocks (a ``HeadWeight``), its top ``EXACT_TOP_K`` logits of
    each row recomputed in float32 from the exact rows."""

    def __init__(self, weight: HeadWeight) -> None:
        self.weight = weight

    def logits(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """`(N, hidden)` -> `(N, vocab)` float32. ``bitmask`` `(N, W)` (grammars' masks,
        ``sampler.bitmask_words``): the top logits recomputed are the top ALLOWED ones, so that
        a constrained row draws from exact logits even where the model prefers what the
        grammar forbids."""
        head = self.weight
        logits = head.mm(hidden)  # (N, vocab), int8-activation precision
        k = min(EXACT_TOP_K, logits.shape[-1])
        ranked = logits if bitmask is None else mask_logits(logits, bitmask)
        if kernels.runs_on(ranked):
            top = FUSED.top_k_ids(ranked.contiguous(), k)  # (N, k), one pass a row
        else:
            top = ranked.topk(k, dim=-1).indices  # (N, k)
        exact = head.dot_rows(hidden, top)  # (N, k)
        return logits.scatter_(1, top, exact)


def mask_logits(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``logits`` ``(S, V)`` float32 with every token its row's mask forbids at -inf (a new
    tensor)."""
    out = logits.float().contiguous().clone()
    if kernels.runs_on(out):
        torch.ops.kvwise.mask_logits(out, words)
        return out
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # (S, W, 32)
    allowed = bits.view(words.shape[0], -1)[:, : out.shape[1]].bool()
    if allowed.shape[1] < out.shape[1]:
        pad = allowed.new_zeros(allowed.shape[0], out.shape[1] - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    return out.masked_fill_(~allowed, float("-inf"))

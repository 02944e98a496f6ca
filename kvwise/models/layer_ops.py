"""How a decoder layer's step is computed: the stages, one class per way of computing them.

The step (``DecoderLayer.forward``) is written once, over four stages of its ``LayerOps``:

    qkv = ops.norm_qkv(residual)                  # input norm, q/k/v projection  (T, q + 2kv)
    q, k, v = ops.qkv_rope(qkv, rope_cos, rope_sin)  # bias, q/k norm, rotary
    o = ops.o_proj(attn(layer_idx, q, k, v))      # output projection             (T, hidden)
    ops.add_mlp(residual, o)                      # residual += o; residual += MLP(norm(residual))

Implementations, chosen once per layer when its weights are installed (``choose_layer_ops``;
the step never dispatches on a name):

- ``TorchLayerOps`` (``ops="torch"``): plain torch ops around each weight's ``mm`` (float on
  f32mm, int8, int4 on q4mm): any weights, any family (its norm form, activation, post-norms).
- ``Int4FusedOps`` (``ops="fused"``, int4 weights): the int4 matmuls inside kvwise's fused ops,
  five op calls a layer (``rms_norm_q4mm``, ``qkv_rope``, ``q4mm``, ``mlp_q4``), float32 around
  the int4 x int8 kernel.
- ``Int8FusedOps`` (``ops="fused"``, int8 weights): ``rms_norm_bf16`` / ``add_rms_norm_bf16`` /
  ``silu_mul_bf16`` and ``qkv_rope`` between torch's int8 matmuls (~8 ops a layer, not ~35).
- ``BlockFusedOps`` (``ops="fused"``, a GGUF file's block types, or int4 weights of a family
  the int4 ops do not compute): float32 ``rms_norm_f32`` / ``add_rms_normed_f32`` /
  ``qkv_rope`` / a GLU op around each weight's own matmul (seven ops a layer).

The int4 and int8 fused ops hard-wire Llama's choices (plain RMSNorm, a SiLU gate, the residual
adds right after attention and the MLP): they apply only where the family's
``fused_ops_apply()``. ``BlockFusedOps`` also computes Gemma's (``1 + w`` norms, post-norms,
GeGLU), so a Gemma GGUF's own block types, or int4 weights of it, run fused too; a family of
other choices runs ``TorchLayerOps`` on every weight format. All compute the same
arithmetic up to float rounding. Each instance holds its layer's tensors (the parameters are
filled in place by the loader; installing other weights chooses the ops again).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvwise import kernels
from kvwise.models.layer_weights import LINEAR_NAMES, LayerWeights
from kvwise.models.layers import GLUS, NORMS, apply_rope
from kvwise.models.linear import FUSED
from kvwise.models.quant import Int4Weight, Int8Weight


class LayerOps(Protocol):
    """The stages of one layer's step (see the module docstring)."""

    name: str  # "fused" or "torch": what ``choose_layer_ops`` was asked for

    def norm_qkv(self, residual: torch.Tensor) -> torch.Tensor: ...

    def qkv_rope(
        self, qkv: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def o_proj(self, out: torch.Tensor) -> torch.Tensor: ...

    def add_mlp(self, residual: torch.Tensor, o: torch.Tensor) -> None: ...


class _LayerTensors:
    """What every implementation reads of its layer, as plain attributes (a module's
    parameters cost a ``__getattr__`` each time they are read)."""

    def __init__(self, layer: LayerWeights) -> None:
        self.eps = layer.eps
        self.num_heads, self.num_kv_heads, self.head_dim = (
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
        )
        self.q_size, self.kv_size, self.inter = layer.q_size, layer.kv_size, layer.intermediate_size
        self.input_norm, self.mlp_norm = layer.input_norm, layer.mlp_norm
        self.attn_out_norm, self.mlp_out_norm = layer.attn_out_norm, layer.mlp_out_norm
        self.qkv_bias, self.qk_norm, self.o_bias = layer.qkv_bias, layer.qk_norm, layer.o_bias


class TorchLayerOps(_LayerTensors):
    """Plain torch ops around the weights' ``mm``: any weight format, any family."""

    name = "torch"

    @staticmethod
    def applies(layer: LayerWeights) -> bool:
        return True

    def __init__(self, layer: LayerWeights) -> None:
        super().__init__(layer)
        self.norm = NORMS[layer.family.norm]
        self.glu = GLUS[layer.family.activation]
        self.qkv, self.o = layer.linear("qkv_proj"), layer.linear("o_proj")
        self.moe = layer.moe  # a mixture of experts in the dense MLP's place (models/moe.py)
        if self.moe is None:
            self.gate_up, self.down = layer.linear("gate_up_proj"), layer.linear("down_proj")

    def norm_qkv(self, residual: torch.Tensor) -> torch.Tensor:
        x = self.norm(residual, self.input_norm, self.eps)  # (T, hidden)
        # int8 weights answer in bfloat16: q/k/v go on in the residual stream's dtype
        return self.qkv.mm(x).to(residual.dtype)  # (T, q + 2kv)

    def qkv_rope(self, qkv, rope_cos, rope_sin):
        if self.qkv_bias is not None:
            qkv.add_(self.qkv_bias)
        num_tokens = qkv.shape[0]
        heads, qk_heads = self.num_heads, self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, qk_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = self.norm(qk, self.qk_norm, self.eps)  # (T, H + KV, D)
        qk = apply_rope(qk, rope_cos, rope_sin)  # (T, H + KV, D)
        return qk[:, :heads], qk[:, heads:], v

    def o_proj(self, out: torch.Tensor) -> torch.Tensor:
        return self.o.mm(out)  # (T, hidden)

    def add_mlp(self, residual: torch.Tensor, o: torch.Tensor) -> None:
        if self.attn_out_norm is not None:  # post-norms: the output normed before its add
            if self.o_bias is not None:
                o = o + self.o_bias
            residual.add_(self.norm(o, self.attn_out_norm, self.eps))
        else:
            residual.add_(o)
            if self.o_bias is not None:
                residual.add_(self.o_bias)
        x = self.norm(residual, self.mlp_norm, self.eps)  # (T, hidden)
        if self.moe is not None:
            out = self.moe(x, self.glu)  # (T, hidden)
        else:
            out = self.down.mm(self.glu(self.gate_up.mm(x), self.inter))  # (T, hidden)
        if self.mlp_out_norm is not None:
            out = self.norm(out, self.mlp_out_norm, self.eps)
        residual.add_(out)


# what the fused ops compute of a family: its norm's weight offset (the int4 and int8 ones only
# Llama's, 0), and the float32 block ops' GLU op for its activation
_NORM_OFFSETS = {"rms": 0.0, "rms_one_plus": 1.0}
_BLOCK_GLUS = {"silu": "silu_mul_f32", "gelu_tanh": "gelu_tanh_mul_f32"}


class _FusedLayerOps(_LayerTensors):
    """What the fused implementations share: the q/k/v op, and when they apply."""

    name = "fused"

    def __init__(self, layer: LayerWeights) -> None:
        super().__init__(layer)
        self.offset = _NORM_OFFSETS[layer.family.norm]
        self._qkv_rope = FUSED.qkv_rope

    @staticmethod
    def _quantized(layer: LayerWeights, computes_family: bool) -> list | None:
        """The layer's quantized weights where the fused ops may run it (the kernels built,
        weights quantized, a family the ops compute), else None."""
        if not (kernels.available() and computes_family and layer.quant):
            return None
        names = LINEAR_NAMES if layer.moe is None else ("qkv_proj", "o_proj")  # and experts
        return [layer.quant[name] for name in names]

    def qkv_rope(self, qkv, rope_cos, rope_sin):
        return self._qkv_rope(
            qkv,
            self.qkv_bias,
            self.qk_norm,
            rope_cos,
            rope_sin,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.offset,
        )


class Int4FusedOps(_FusedLayerOps):
    """int4 weights: their matmuls inside kvwise's fused ops, five op calls a layer."""

    @staticmethod
    def applies(layer: LayerWeights) -> bool:
        weights = _FusedLayerOps._quantized(layer, layer.family.fused_ops_apply())
        return (
            weights is not None
            and layer.moe is None
            and all(isinstance(w, Int4Weight) and w.out_features % 8 == 0 for w in weights)
        )  # no padded output columns

    def __init__(self, layer: LayerWeights) -> None:
        super().__init__(layer)
        self.qkv_w, self.o_w, self.gu_w, self.d_w = (layer.quant[n].packed for n in LINEAR_NAMES)
        self._rms_norm_q4mm, self._q4mm, self._mlp_q4 = (
            FUSED.rms_norm_q4mm,
            FUSED.q4mm,
            FUSED.mlp_q4,
        )

    def norm_qkv(self, residual: torch.Tensor) -> torch.Tensor:
        return self._rms_norm_q4mm(residual, self.input_norm, self.eps, self.qkv_w)

    def o_proj(self, out: torch.Tensor) -> torch.Tensor:
        o = self._q4mm(out, self.o_w)  # (T, hidden)
        if self.o_bias is not None:
            o.add_(self.o_bias)
        return o

    def add_mlp(self, residual: torch.Tensor, o: torch.Tensor) -> None:
        self._mlp_q4(residual, o, self.mlp_norm, self.eps, self.gu_w, self.d_w)


class Int8FusedOps(_FusedLayerOps):
    """int8 weights: kvwise's bfloat16 ops between torch's int8 matmuls."""

    @staticmethod
    def applies(layer: LayerWeights) -> bool:
        weights = _FusedLayerOps._quantized(layer, layer.family.fused_ops_apply())
        return (
            weights is not None
            and layer.moe is None
            and all(isinstance(w, Int8Weight) for w in weights)
        )

    def __init__(self, layer: LayerWeights) -> None:
        super().__init__(layer)
        self.qkv, self.o, self.gate_up, self.down = (layer.quant[n] for n in LINEAR_NAMES)
        self._rms_norm, self._add_rms_norm, self._silu_mul = (
            FUSED.rms_norm_bf16,
            FUSED.add_rms_norm_bf16,
            FUSED.silu_mul_bf16,
        )

    def norm_qkv(self, residual: torch.Tensor) -> torch.Tensor:
        x = self._rms_norm(residual, self.input_norm, self.eps)  # (T, hidden) bf16
        return self.qkv.mm(x)  # (T, q + 2kv) bf16

    def o_proj(self, out: torch.Tensor) -> torch.Tensor:
        return self.o.mm(out)  # (T, hidden) bf16

    def add_mlp(self, residual: torch.Tensor, o: torch.Tensor) -> None:
        if self.o_bias is None:
            x = self._add_rms_norm(residual, o, self.mlp_norm, self.eps)  # residual += o
        else:
            residual.add_(o).add_(self.o_bias)
            x = self._rms_norm(residual, self.mlp_norm, self.eps)
        gate = self._silu_mul(self.gate_up.mm(x))  # (T, inter) bf16
        residual.add_(self.down.mm(gate))  # (T, hidden)


class BlockFusedOps(_FusedLayerOps):
    """Weights of other block formats (a GGUF file's own types: ``Q8Weight``,
    ``gguf_blocks.BlockWeight``, their mixes; int4 weights of a family the int4 ops do not
    compute), float32 in and out: kvwise's float32 norm, q/k/v and GLU ops around the
    weights' own matmuls, seven op calls a layer. Llama's choices and Gemma's (RMSNorms by
    ``1 + w``, post-norms, GeGLU). A mixture-of-experts layer: its attention so, its experts
    (``models/moe.py``) on the same GLU op in the dense MLP's place (float32 layers)."""

    @staticmethod
    def applies(layer: LayerWeights) -> bool:
        family = layer.family
        computes = family.norm in _NORM_OFFSETS and family.activation in _BLOCK_GLUS
        weights = _FusedLayerOps._quantized(layer, computes)
        float32 = layer.moe is None or layer.input_norm.dtype == torch.float32
        return (
            weights is not None and float32 and not any(isinstance(w, Int8Weight) for w in weights)
        )

    def __init__(self, layer: LayerWeights) -> None:
        super().__init__(layer)
        self.moe = layer.moe
        self.qkv, self.o = layer.quant["qkv_proj"], layer.quant["o_proj"]
        if self.moe is None:
            self.gate_up, self.down = layer.quant["gate_up_proj"], layer.quant["down_proj"]
        self._rms_norm, self._add_normed = FUSED.rms_norm_f32, FUSED.add_rms_normed_f32
        self._glu = getattr(FUSED, _BLOCK_GLUS[layer.family.activation])

    def norm_qkv(self, residual: torch.Tensor) -> torch.Tensor:
        x = self._rms_norm(residual, self.input_norm, self.eps, self.offset)
        return self.qkv.mm(x)  # float32

    def o_proj(self, out: torch.Tensor) -> torch.Tensor:
        o = self.o.mm(out)  # (T, hidden)
        if self.o_bias is not None:
            o.add_(self.o_bias)
        return o

    def add_mlp(self, residual: torch.Tensor, o: torch.Tensor) -> None:
        self._add(residual, o, self.attn_out_norm)
        x = self._rms_norm(residual, self.mlp_norm, self.eps, self.offset)
        if self.moe is not None:  # gate | up halves: the op's split at inter
            self._add(
                residual, self.moe(x, lambda gate_up, _: self._glu(gate_up)), self.mlp_out_norm
            )
        else:
            self._add(residual, self.down.mm(self._glu(self.gate_up.mm(x))), self.mlp_out_norm)

    def _add(self, residual: torch.Tensor, y: torch.Tensor, norm: torch.Tensor | None) -> None:
        """residual += y, normed first where the family has that post-norm."""
        if norm is None:
            residual.add_(y)
        else:
            self._add_normed(residual, y, norm, self.eps, self.offset)


# what each ``ops`` value may choose, fastest first; None: the fastest of all that applies
_CHOICES = {"fused": (Int4FusedOps, Int8FusedOps, BlockFusedOps), "torch": (TorchLayerOps,)}
OPS = tuple(_CHOICES)


def choose_layer_ops(layer: LayerWeights, ops: str | None = None) -> LayerOps:
    """The ``LayerOps`` that computes ``layer`` with its current weights.

    Args:
        ops: "fused" (kvwise's fused ops: int4 or int8 weights, the kernels built, a family
            of Llama's choices), "torch" (plain torch, always), or None (the fastest that can).

    Raises:
        ValueError: ``ops`` is neither, or "fused" cannot run this layer here.
    """
    if ops is not None and ops not in _CHOICES:
        raise ValueError(f"ops: expected one of {', '.join(map(repr, OPS))} or None, got {ops!r}")
    candidates = _CHOICES[ops] if ops else tuple(c for group in _CHOICES.values() for c in group)
    for implementation in candidates:
        if implementation.applies(layer):
            return implementation(layer)
    raise ValueError(
        f"ops: {ops!r} cannot run this layer here (it needs the kvwise kernels, int4 or int8 "
        "weights, int4 outputs in multiples of 8 and a family of Llama's or Gemma's choices)"
    )

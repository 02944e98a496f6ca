"""One decoder block's weights, apart from its step: what the layer ops (``layer_ops``) read,
what the checkpoint loaders (``checkpoint``) fill, and what ``decoder.DecoderLayer`` computes
with. The fused layout is ``models/decoder.py``'s."""

from __future__ import annotations

import torch
from torch import nn

from kvwise.models.arch import ModelArchConfig
from kvwise.models.family import ModelFamily
from kvwise.models.linear import FloatWeight, Linear, param
from kvwise.models.moe import MoEWeights
from kvwise.models.quant import QuantWeight

LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LayerWeights(nn.Module):
    """One decoder block's weights: fused, transposed `[in, out]` parameters (see
    ``models/decoder.py``), or quantized ones in their place (``quant``)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        family: type[ModelFamily],
        dtype: torch.dtype,
        moe: bool = False,
    ):
        super().__init__()
        hidden, inter = arch.hidden_size, arch.intermediate_size
        self.family = family
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.intermediate_size = inter
        self.eps = arch.rms_norm_eps
        qkv_size = self.q_size + 2 * self.kv_size
        self.input_norm = param(hidden, dtype=dtype)
        self.qkv_proj = param(hidden, qkv_size, dtype=dtype)  # [in, q | k | v]
        self.qkv_bias = param(qkv_size, dtype=dtype) if arch.attention_bias else None
        # q/k norm: q's weight in rows [:num_heads], k's in rows [num_heads:].
        self.qk_norm = (
            param(arch.num_heads + arch.num_kv_heads, arch.head_dim, dtype=dtype)
            if arch.qk_norm
            else None
        )
        self.o_proj = param(self.q_size, hidden, dtype=dtype)
        self.o_bias = param(hidden, dtype=dtype) if arch.o_proj_bias else None
        # a learned logit per query head in every softmax's denominator (gpt-oss), float32
        self.sinks = param(arch.num_heads, dtype=torch.float32) if arch.attention_sinks else None
        # post-norm families norm the attention and MLP outputs before their residual adds
        self.attn_out_norm = param(hidden, dtype=dtype) if family.post_norms else None
        self.mlp_norm = param(hidden, dtype=dtype)  # the MLP's input norm
        # a dense MLP, or (``moe``) a mixture of experts in its place (``models/moe.py``)
        self.moe = MoEWeights(arch, dtype) if moe else None
        self.gate_up_proj = None if moe else param(hidden, 2 * inter, dtype=dtype)  # [in, g | u]
        self.down_proj = None if moe else param(inter, hidden, dtype=dtype)
        self.mlp_out_norm = param(hidden, dtype=dtype) if family.post_norms else None
        self.quant: dict[str, QuantWeight] | None = None  # LINEAR_NAMES name -> weight

    def linear(self, name: str) -> Linear:
        """The linear weight ``name`` (one of ``LINEAR_NAMES``) as the ops apply it."""
        if self.quant is not None:
            return self.quant[name]
        weight = getattr(self, name)
        if weight is None:
            raise ValueError(f"weights: this layer has no {name} (its MLP is a mixture of experts)")
        return FloatWeight(weight)

    def part_sizes(self) -> dict[str, tuple[int, ...]]:
        """Each fused linear weight's output columns per HF part, in the family's order."""
        q, kv, inter = self.q_size, self.kv_size, self.intermediate_size
        hidden = self.input_norm.shape[0]
        return {
            "qkv_proj": (q, kv, kv),
            "o_proj": (hidden,),
            "gate_up_proj": (inter, inter),
            "down_proj": (hidden,),
        }

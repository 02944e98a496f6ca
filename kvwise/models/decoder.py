"""The decoder of every model family, with pluggable attention: one step, written once.

The model sees a flat batch of `T` tokens from any number of sequences (varlen) and their
positions; it never sees sequence boundaries or the KV cache. Each layer calls

    attn(layer_idx, q, k, v) -> (T, num_heads * head_dim)

with q `(T, num_heads, head_dim)` and k, v `(T, num_kv_heads, head_dim)` after rotary (and after
the q/k norm where the checkpoint has one). q is not pre-scaled: attention applies the scale.
q, k and v may be non-contiguous views; attention must not write into them. The engine's
attention writes k, v into its paged cache and attends over each sequence's cached prefix.
``CausalLM.attention_kinds`` says, per layer, which attention its family declares (window,
rotary, scale): the rotary is applied here, the rest is the attention's.

What differs between families (norm form, activation, post-norms, embedding scale, logit
soft cap, attention kinds, tensor names) is the family's declaration (``models/family.py``),
read once when the model is built. How a layer's stages are computed (plain torch, or
kvwise's fused ops for int4 / int8 weights) is its ``LayerOps`` (``models/layer_ops.py``),
chosen once per layer when its weights are installed.

Layout, chosen for memory-bound CPU decode:
- every linear weight is stored transposed, contiguous `[in, out]`, and applied as `x @ w`;
- q/k/v are one fused weight, gate/up are one fused weight;
- float32 matmuls run on kvwise's ``f32mm`` where the kernels are built (a fixed order of
  operations for every output, so a row's bits never depend on the batch; else ``torch.mm``);
- with tied embeddings, `embed` `[vocab, hidden]` serves lookup and `lm_head` `[hidden, vocab]`
  is a separate transposed copy for logits.

Quantized weights (``models/quant.py``, installed by ``install_quantized``) replace the four
linear weights of every layer and the embedding / LM head. The step then stays float32 where
precision matters (the residual stream, norms, rotary, attention, logits). int4 weights (and
the int8-block embedding / LM head) run kvwise's kernels, which quantize their float32 input
to int8 per block of 32 as llama.cpp does; int8 per-channel weights run torch's kernel on
bfloat16 inputs. The quantized LM head's top logits are refined in float32
(``linear.RefinedHead``); a family's soft cap applies after that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvwise.models.arch import ModelArchConfig
from kvwise.models.family import ModelFamily
from kvwise.models.layer_ops import LayerOps, TorchLayerOps, choose_layer_ops
from kvwise.models.layer_weights import LINEAR_NAMES, LayerWeights
from kvwise.models.layers import NORMS, rope_table, soft_cap
from kvwise.models.linear import FloatHead, HeadWeight, RefinedHead, param
from kvwise.models.mla import MLALayer
from kvwise.models.quant import QuantWeight
from kvwise.models.registry import family_for

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderLayer(LayerWeights):
    """One pre-norm decoder block: its weights (``LayerWeights``) and its step, computed by
    its ``LayerOps``. Weights are `[in, out]`; see the module docstring."""

    def __init__(
        self,
        arch: ModelArchConfig,
        family: type[ModelFamily],
        dtype: torch.dtype,
        moe: bool = False,
    ):
        super().__init__(arch, family, dtype, moe)
        self.ops: LayerOps = choose_layer_ops(self)

    def install_quantized(self, weights: dict[str, QuantWeight], ops: str | None = None) -> None:
        """Replace the four linear weights with quantized ones (their float parameters go) and
        choose the layer's ops again (``use_ops``); a mixture-of-experts layer: its two
        attention ones (its experts: ``MoEWeights.install_quantized``)."""
        names = LINEAR_NAMES if self.moe is None else ("qkv_proj", "o_proj")
        if set(weights) != set(names):
            raise ValueError(f"weights: expected {sorted(names)}, got {sorted(weights)}")
        for name, weight in weights.items():
            expected = tuple(getattr(self, name).shape[::-1])  # [in, out] -> (out, in)
            if (weight.out_features, weight.in_features) != expected:
                raise ValueError(
                    f"weights: {name} is {weight.out_features}x"
                    f"{weight.in_features}, expected {expected[0]}x{expected[1]}"
                )
        for name in weights:
            setattr(self, name, None)
        self.quant = dict(weights)
        try:
            self.use_ops(ops)
        except ValueError:
            self.ops = TorchLayerOps(self)  # never the ops of the float weights just dropped
            raise

    def use_ops(self, ops: str | None = None) -> None:
        """Compute this layer with ``ops``: "fused" (kvwise's fused ops; int4 or int8 weights,
        the kernels, a family they compute), "torch" (plain torch ops, any weights, any family)
        or None (the fastest that can). The same arithmetic up to float rounding.

        Raises:
            ValueError: a value other than these, or "fused" where it cannot run (the layer
                keeps the ops it had).
        """
        self.ops = choose_layer_ops(self, ops)

    def forward(
        self,
        layer_idx: int,
        residual: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        attn: AttentionFn,
    ) -> torch.Tensor:
        """Update `residual` `(T, hidden)` IN PLACE with this block's attention and MLP output."""
        ops = self.ops
        q, k, v = ops.qkv_rope(ops.norm_qkv(residual), rope_cos, rope_sin)
        ops.add_mlp(residual, ops.o_proj(attn(layer_idx, q, k, v)))
        return residual


class CausalLM(nn.Module):
    """A causal LM of any registered family. Weights start uninitialized: fill them with
    ``checkpoint.load_weights`` (and `install_quantized`)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        family: type[ModelFamily] | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.family = family = family or family_for(arch.architecture)
        self.embed = param(arch.vocab_size, arch.hidden_size, dtype=dtype)  # [vocab, hidden]
        layer = MLALayer if arch.kv_lora_rank else DecoderLayer  # latent attention: mla.py
        self.layers = nn.ModuleList(
            layer(arch, family, dtype, arch.is_moe_layer(i)) for i in range(arch.num_layers)
        )
        self.norm = param(arch.hidden_size, dtype=dtype)
        self.lm_head = param(arch.hidden_size, arch.vocab_size, dtype=dtype)  # [hidden, vocab]
        self._final_norm = NORMS[family.norm]
        scale = family.embedding_scale(arch)
        embed_scale = None if scale is None else torch.tensor(scale, dtype=dtype)
        self.register_buffer("embed_scale", embed_scale, persistent=False)  # moves with .to
        self.logit_softcap = family.logit_softcap(arch)
        self.attention_kinds = family.attention_kinds(arch)
        if len(self.attention_kinds) != arch.num_layers:
            raise ValueError(
                f"family {family.__name__}: {len(self.attention_kinds)} attention "
                f"kinds for {arch.num_layers} layers"
            )
        self._init_rope(arch)
        self.head: FloatHead | RefinedHead = FloatHead(self.lm_head)
        # quantized embedding (its rows) and LM head; tied: the same weight
        self.embed_quant: HeadWeight | None = None
        self.lm_head_quant: HeadWeight | None = None

    def _init_rope(self, arch: ModelArchConfig) -> None:
        """One rotary table per distinct (base, scaling) of the layers' attention kinds."""
        ropes = list(dict.fromkeys((k.rope_theta, k.rope_scaling) for k in self.attention_kinds))
        for i, (theta, scaling) in enumerate(ropes):
            table = rope_table(arch.max_position_embeddings, arch.rope_dim, theta, scaling)
            self.register_buffer(f"rope{i or ''}", table.to(self.dtype), persistent=False)
        self._rope_names = [f"rope{i or ''}" for i in range(len(ropes))]  # (P, 2, D) each
        # each layer's table, by index into rope_names
        self._layer_rope = [
            ropes.index((k.rope_theta, k.rope_scaling)) for k in self.attention_kinds
        ]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        """Run the decoder over a flat batch of tokens.

        Args:
            input_ids: `(T,)` int64 token ids, tokens of all sequences concatenated.
            positions: `(T,)` int64 position of each token in its sequence,
                `< arch.max_position_embeddings`.
            attn: called once per layer, see the module docstring.

        Returns:
            `(T, hidden)` final-normed hidden states; pass the rows to sample to `compute_logits`.
        """
        ropes = []
        for name in self._rope_names:
            rope = getattr(self, name)[positions]  # (T, 2, D)
            ropes.append((rope[:, 0:1], rope[:, 1:2]))  # cos, signed sin (T, 1, D) each
        if self.embed_quant is not None:
            residual = self.embed_quant.rows(input_ids)  # (T, hidden), a fresh tensor we own
        else:
            residual = F.embedding(input_ids, self.embed)  # (T, hidden), a fresh tensor we own
        if self.embed_scale is not None:
            residual.mul_(self.embed_scale)
        for layer_idx, (layer, rope) in enumerate(zip(self.layers, self._layer_rope)):
            rope_cos, rope_sin = ropes[rope]
            layer.forward(layer_idx, residual, rope_cos, rope_sin, attn)
        return self._final_norm(residual, self.norm, self.arch.rms_norm_eps)  # (T, hidden)

    def compute_logits(
        self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`(N, hidden)` -> `(N, vocab)` float32 logits; ``bitmask`` `(N, W)` int32: the
        tokens grammars allow (a quantized head refines the top allowed logits)."""
        logits = self.head.logits(hidden, bitmask)  # (N, vocab)
        if self.logit_softcap is not None:
            logits = soft_cap(logits, self.logit_softcap)
        return logits

    def to_device(self, device: torch.device) -> CausalLM:
        """Move the weights to ``device`` and bind what holds them again (each layer's ops,
        the LM head): ``Module.to`` may give a parameter a new tensor. Float weights only:
        the quantized ones are the CPU kernels' (``worker/device.py``)."""
        if self.embed_quant is not None or any(layer.quant for layer in self.layers):
            raise ValueError(f"quantization: quantized weights run on the CPU only, not {device}")
        self.to(device)
        self.head = FloatHead(self.lm_head)
        self.use_ops()
        return self

    def use_ops(self, ops: str | None = None) -> None:
        """``DecoderLayer.use_ops`` for every layer (raises before changing any)."""
        layers = [layer for layer in self.layers if not isinstance(layer, MLALayer)]  # own step
        chosen = [choose_layer_ops(layer, ops) for layer in layers]
        for layer, layer_ops in zip(layers, chosen):
            layer.ops = layer_ops

    def install_quantized(
        self,
        layers: list[dict[str, QuantWeight]],
        embed: HeadWeight,
        lm_head: HeadWeight,
        ops: str | None = None,
    ) -> None:
        """Replace every layer's linear weights, the embedding and the LM head with quantized
        ones (their float parameters go), computed with ``ops`` (``DecoderLayer.use_ops``).
        The norms (and biases) stay float parameters."""
        if len(layers) != len(self.layers):
            raise ValueError(f"weights: {len(layers)} quantized layers for {len(self.layers)}")
        self._check_heads(embed, lm_head)
        for layer, weights in zip(self.layers, layers):
            layer.install_quantized(weights, ops)  # type: ignore[operator]
        self.install_heads(embed, lm_head)

    def _check_heads(self, embed, lm_head) -> None:
        vocab, hidden = self.arch.vocab_size, self.arch.hidden_size
        for name, weight in (("embed", embed), ("lm_head", lm_head)):
            if weight is not None and (weight.out_features, weight.in_features) != (vocab, hidden):
                raise ValueError(
                    f"weights: {name} is {weight.out_features}x"
                    f"{weight.in_features}, expected {vocab}x{hidden}"
                )

    def install_heads(self, embed: HeadWeight | None, lm_head: HeadWeight | None) -> None:
        """The embedding and the LM head as quantized weights with exact rows (``Q8Weight``,
        ``BlockWeight``; their float parameters go), or None to keep that one float (a tied
        float head then copies the float embedding)."""
        self._check_heads(embed, lm_head)
        if embed is not None:
            self.embed_quant, self.embed = embed, None  # type: ignore[assignment]
        if lm_head is not None:
            self.lm_head_quant, self.lm_head = lm_head, None  # type: ignore[assignment]
            self.head = RefinedHead(lm_head)
        elif self.arch.tie_word_embeddings and self.embed is not None:
            with torch.no_grad():
                self.lm_head.copy_(self.embed.t())

    def weight_bytes(self) -> int:
        """Bytes the weights take (quantized ones at their packed size)."""
        total = sum(p.nbytes for p in self.parameters())
        for layer in self.layers:
            total += sum(w.nbytes for w in (layer.quant or {}).values())
            total += layer.moe.nbytes_quantized() if layer.moe is not None else 0
        for head in {id(w): w for w in (self.embed_quant, self.lm_head_quant) if w}.values():
            total += head.nbytes
        return total

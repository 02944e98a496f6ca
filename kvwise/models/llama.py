"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) with pluggable attention.

The model sees a flat batch of `T` tokens from any number of sequences (varlen) and their
positions; it never sees sequence boundaries or the KV cache. Each layer calls

    attn(layer_idx, q, k, v) -> (T, num_heads * head_dim)

with q `(T, num_heads, head_dim)` and k, v `(T, num_kv_heads, head_dim)` after rotary (and after
the q/k norm for Qwen3). q is not pre-scaled: attention applies `head_dim ** -0.5`. q, k and v
may be non-contiguous views; attention must not write into them. The engine's attention writes
k, v into its paged cache and attends over each sequence's cached prefix.

Layout, chosen for memory-bound CPU decode:
- every linear weight is stored transposed, contiguous `[in, out]`, and applied as `x @ w`;
- q/k/v are one fused weight, gate/up are one fused weight;
- float32 matmuls run on kvwise's ``f32mm`` where the kernels are built (a fixed order of
  operations for every output, so a row's bits never depend on the batch; else ``torch.mm``);
- with tied embeddings, `embed` `[vocab, hidden]` serves lookup and `lm_head` `[hidden, vocab]`
  is a separate transposed copy for logits.

Quantized weights (``models/quant.py``, installed by ``load_quantized``) replace the four
linear weights of every layer and the embedding / LM head. The step then stays float32 where
precision matters (the residual stream, norms, rotary, attention, logits). int4 weights (and
the int8-block embedding / LM head) run kvwise's kernels, which quantize their float32 input
to int8 per block of 32 as llama.cpp does; int8 per-channel weights run torch's kernel on
bfloat16 inputs. The LM head's output is refined: the top ``_EXACT_TOP_K`` logits of each row
are recomputed in float32 from the exact rows, so greedy picks and the head of the
distribution are as precise as the float path's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvwise import kernels
from kvwise.models.arch import ModelArchConfig
from kvwise.models.layers import apply_rope, rms_norm, rope_table
from kvwise.models.quant import Int4Weight, Q8Weight, QuantWeight

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# HF checkpoint names that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# the logits recomputed in float32 after the quantized LM head (per row)
_EXACT_TOP_K = 64
# the linear weights of a layer, by the HF names of their parts (fused in this order)
LINEAR_PARTS = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _FusedOps:
    """The kernels' overloads, looked up once (``torch.ops`` attribute access per call costs)."""

    def __getattr__(self, name: str):
        op = getattr(torch.ops.kvwise, name).default
        setattr(self, name, op)
        return op


_FUSED = _FusedOps()


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for the float path: float32 on kvwise's ``f32mm`` where the kernels are built
    (each output one fma chain down k: a row's bits do not depend on the other rows, where a
    BLAS picks other kernels for other row counts), else ``torch.mm``."""
    if w.dtype == torch.float32 and x.dtype == torch.float32 and kernels.available():
        return _FUSED.f32mm(x, w)
    return torch.mm(x, w)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder block. Weights are `[in, out]`; see the module docstring."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = arch.hidden_size, arch.intermediate_size
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.intermediate_size = inter
        self.eps = arch.rms_norm_eps
        qkv_size = self.q_size + 2 * self.kv_size
        self.input_norm = _param(hidden, dtype=dtype)
        self.qkv_proj = _param(hidden, qkv_size, dtype=dtype)  # [in, q | k | v]
        self.qkv_bias = _param(qkv_size, dtype=dtype) if arch.attention_bias else None
        # Qwen3: q_norm weight in rows [:num_heads], k_norm in rows [num_heads:].
        self.qk_norm = (
            _param(arch.num_heads + arch.num_kv_heads, arch.head_dim, dtype=dtype)
            if arch.qk_norm
            else None
        )
        self.o_proj = _param(self.q_size, hidden, dtype=dtype)
        self.o_bias = _param(hidden, dtype=dtype) if arch.o_proj_bias else None
        self.post_attention_norm = _param(hidden, dtype=dtype)
        self.gate_up_proj = _param(hidden, 2 * inter, dtype=dtype)  # [in, gate | up]
        self.down_proj = _param(inter, hidden, dtype=dtype)
        self.quant: dict[str, QuantWeight] | None = None  # LINEAR_PARTS name -> weight
        # the quantized step this layer runs (``select_step``): "int4", "fused" or "torch"
        self.step: str | None = None
        self.int4_args: tuple | None = None  # the packed int4 weight of each linear part
        self._quantized_step = None

    def install_quantized(self, weights: dict[str, QuantWeight]) -> None:
        """Replace the four linear weights with quantized ones (their float parameters go)."""
        if set(weights) != set(LINEAR_PARTS):
            raise ValueError(f"weights: expected {sorted(LINEAR_PARTS)}, got {sorted(weights)}")
        for name, weight in weights.items():
            expected = tuple(getattr(self, name).shape[::-1])  # [in, out] -> (out, in)
            if (weight.out_features, weight.in_features) != expected:
                raise ValueError(f"weights: {name} is {weight.out_features}x"
                                 f"{weight.in_features}, expected {expected[0]}x{expected[1]}")  # fmt: skip
            setattr(self, name, None)
        self.quant = dict(weights)
        self.select_step()

    def select_step(self, step: str | None = None) -> None:
        """Choose the quantized step: ``"int4"`` (int4 weights: the int4 matmuls run inside
        kvwise's fused ops; needs the kernels), ``"fused"`` (int8 weights: kvwise's fused ops
        between torch's int8 matmuls; needs the kernels) or ``"torch"`` (plain torch ops, any
        weights). The same arithmetic in each up to float rounding; None picks the fastest
        this layer can run."""
        weights = [self.quant[name] for name in LINEAR_PARTS]
        int4 = [isinstance(w, Int4Weight) for w in weights]
        can = {
            "int4": kernels.available()
            and all(int4)
            and all(w.out_features % 8 == 0 for w in weights),  # no padded columns
            "fused": kernels.available() and not any(int4),
            "torch": True,
        }
        if step is None:
            step = next(name for name, ok in can.items() if ok)
        if step not in can:
            raise ValueError(f"step: expected 'int4', 'fused' or 'torch', got {step!r}")
        if not can[step]:
            raise ValueError(f"step: {step!r} cannot run this layer here")
        self.step = step
        self.int4_args = tuple(w.packed for w in weights) if step == "int4" else None
        self._quantized_step = {
            "int4": self._forward_int4,
            "fused": self._forward_fused,
            "torch": self._forward_quantized,
        }[step]

    def forward(
        self,
        layer_idx: int,
        residual: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        attn: AttentionFn,
    ) -> torch.Tensor:
        """Update `residual` `(T, hidden)` IN PLACE with this block's attention and MLP output."""
        if self._quantized_step is not None:
            return self._quantized_step(layer_idx, residual, rope_cos, rope_sin, attn)
        x = rms_norm(residual, self.input_norm, self.eps)  # (T, hidden)
        qkv = _mm(x, self.qkv_proj)  # (T, q + 2kv)
        if self.qkv_bias is not None:
            qkv.add_(self.qkv_bias)
        out = self._attend(layer_idx, qkv, rope_cos, rope_sin, attn)  # (T, H * D)
        residual.add_(_mm(out, self.o_proj))  # (T, hidden)
        if self.o_bias is not None:
            residual.add_(self.o_bias)
        x = rms_norm(residual, self.post_attention_norm, self.eps)  # (T, hidden)
        gate_up = _mm(x, self.gate_up_proj)  # (T, 2 * inter)
        gate = F.silu(gate_up[:, : self.intermediate_size], inplace=True)  # (T, inter), a view
        gate.mul_(gate_up[:, self.intermediate_size :])
        residual.add_(_mm(gate, self.down_proj))  # (T, hidden)
        return residual

    def _attend(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        attn: AttentionFn,
    ) -> torch.Tensor:
        """q/k/v out of the fused projection `(T, q + 2kv)`, q/k norm, rotary, attention."""
        num_tokens = qkv.shape[0]
        heads, qk_heads = self.num_heads, self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, qk_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)  # (T, H + KV, D)
        qk = apply_rope(qk, rope_cos, rope_sin)  # (T, H + KV, D)
        return attn(layer_idx, qk[:, :heads], qk[:, heads:], v)  # (T, H * D)

    def _forward_quantized(
        self,
        layer_idx: int,
        residual: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        attn: AttentionFn,
    ) -> torch.Tensor:
        """``forward`` on quantized weights, plain torch ops around the quantized matmuls."""
        quant = self.quant
        x = rms_norm(residual, self.input_norm, self.eps)  # (T, hidden) f32
        qkv = quant["qkv_proj"].mm(x).float()  # (T, q + 2kv)
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        out = self._attend(layer_idx, qkv, rope_cos, rope_sin, attn)  # (T, H * D) f32
        residual.add_(quant["o_proj"].mm(out))  # (T, hidden)
        if self.o_bias is not None:
            residual.add_(self.o_bias)
        x = rms_norm(residual, self.post_attention_norm, self.eps)  # (T, hidden)
        gate_up = quant["gate_up_proj"].mm(x)  # (T, 2 * inter) bf16 (int8) or f32 (int4)
        gate = F.silu(gate_up[:, : self.intermediate_size])  # (T, inter)
        gate.mul_(gate_up[:, self.intermediate_size :])
        residual.add_(quant["down_proj"].mm(gate))  # (T, hidden)
        return residual

    def _forward_int4(
        self,
        layer_idx: int,
        residual: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        attn: AttentionFn,
    ) -> torch.Tensor:
        """The step for int4 weights, their matmuls called from inside the fused ops: five
        calls a layer, everything float32 around the int4 x int8 kernel."""
        qkv_w, o_w, gu_w, d_w = self.int4_args
        ops = _FUSED
        qkv = ops.rms_norm_q4mm(residual, self.input_norm, self.eps, qkv_w)  # (T, q + 2kv)
        q, k, v = ops.qkv_rope(qkv, self.qkv_bias, self.qk_norm, rope_cos, rope_sin,
                               self.num_heads, self.num_kv_heads, self.eps)  # fmt: skip
        o = ops.q4mm(attn(layer_idx, q, k, v), o_w)  # (T, hidden)
        if self.o_bias is not None:
            o.add_(self.o_bias)
        ops.mlp_q4(residual, o, self.post_attention_norm, self.eps, gu_w, d_w)
        return residual

    def _forward_fused(
        self,
        layer_idx: int,
        residual: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        attn: AttentionFn,
    ) -> torch.Tensor:
        """``_forward_quantized`` with the steps between the matmuls fused into one op each
        (``kernels/csrc/fused.cpp``): the same arithmetic in ~8 ops a layer instead of ~35."""
        quant, ops = self.quant, _FUSED
        x = ops.rms_norm_bf16(residual, self.input_norm, self.eps)  # (T, hidden) bf16
        qkv = quant["qkv_proj"].mm(x)  # (T, q + 2kv) bf16
        q, k, v = ops.qkv_rope(qkv, self.qkv_bias, self.qk_norm, rope_cos, rope_sin,
                               self.num_heads, self.num_kv_heads, self.eps)  # fmt: skip
        out = attn(layer_idx, q, k, v)  # (T, H * D) f32
        o = quant["o_proj"].mm(out)  # (T, hidden) bf16
        if self.o_bias is None:
            x = ops.add_rms_norm_bf16(residual, o, self.post_attention_norm, self.eps)
        else:
            residual.add_(o).add_(self.o_bias)
            x = ops.rms_norm_bf16(residual, self.post_attention_norm, self.eps)
        gate = ops.silu_mul_bf16(quant["gate_up_proj"].mm(x))  # (T, inter) bf16
        residual.add_(quant["down_proj"].mm(gate))  # (T, hidden)
        return residual


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM. Weights start uninitialized: fill them with `load_weights`."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.embed = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)  # [vocab, hidden]
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, dtype) for _ in range(arch.num_layers))
        self.norm = _param(arch.hidden_size, dtype=dtype)
        self.lm_head = _param(arch.hidden_size, arch.vocab_size, dtype=dtype)  # [hidden, vocab]
        table = rope_table(
            arch.max_position_embeddings, arch.head_dim, arch.rope_theta, arch.rope_scaling
        )
        self.register_buffer("rope", table.to(dtype), persistent=False)  # (P, 2, D)
        # quantized embedding (its rows) and LM head; tied: the same weight
        self.embed_quant: Q8Weight | None = None
        self.lm_head_quant: Q8Weight | None = None

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
        rope = self.rope[positions]  # (T, 2, D)
        rope_cos, rope_sin = rope[:, 0:1], rope[:, 1:2]  # (T, 1, D) each
        if self.embed_quant is not None:
            residual = self.embed_quant.rows(input_ids)  # (T, hidden), a fresh tensor we own
        else:
            residual = F.embedding(input_ids, self.embed)  # (T, hidden), a fresh tensor we own
        for layer_idx, layer in enumerate(self.layers):
            layer.forward(layer_idx, residual, rope_cos, rope_sin, attn)
        return rms_norm(residual, self.norm, self.arch.rms_norm_eps)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`(N, hidden)` -> `(N, vocab)` float32 logits."""
        head = self.lm_head_quant
        if head is None:
            return _mm(hidden, self.lm_head).float()  # (N, vocab)
        logits = head.mm(hidden)  # (N, vocab), int8-activation precision
        k = min(_EXACT_TOP_K, logits.shape[-1])
        if kernels.available():
            top = torch.ops.kvwise.top_k_ids(logits, k)  # (N, k), one pass a row
        else:
            top = logits.topk(k, dim=-1).indices  # (N, k)
        exact = head.dot_rows(hidden, top)  # (N, k)
        return logits.scatter_(1, top, exact)

    def install_quantized(
        self, layers: list[dict[str, QuantWeight]], embed: Q8Weight, lm_head: Q8Weight
    ) -> None:
        """Replace every layer's linear weights, the embedding and the LM head with quantized
        ones (their float parameters go). The norms (and biases) stay float parameters."""
        if len(layers) != len(self.layers):
            raise ValueError(f"weights: {len(layers)} quantized layers for {len(self.layers)}")
        for layer, weights in zip(self.layers, layers):
            layer.install_quantized(weights)  # type: ignore[operator]
        vocab, hidden = self.arch.vocab_size, self.arch.hidden_size
        for name, weight in (("embed", embed), ("lm_head", lm_head)):
            if (weight.out_features, weight.in_features) != (vocab, hidden):
                raise ValueError(f"weights: {name} is {weight.out_features}x"
                                 f"{weight.in_features}, expected {vocab}x{hidden}")  # fmt: skip
        self.embed_quant, self.lm_head_quant = embed, lm_head
        self.embed = self.lm_head = None  # type: ignore[assignment]

    def weight_bytes(self) -> int:
        """Bytes the weights take (quantized ones at their packed size)."""
        total = sum(p.nbytes for p in self.parameters())
        for layer in self.layers:
            total += sum(w.nbytes for w in (layer.quant or {}).values())
        for head in {id(w): w for w in (self.embed_quant, self.lm_head_quant) if w}.values():
            total += head.nbytes
        return total

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], quantized: bool = False
    ) -> None:
        """Copy Hugging Face-named, HF-layout (`[out, in]`) tensors into the fused parameters.

        With tied embeddings `lm_head.weight` is ignored and `lm_head` is copied from `embed`.
        ``quantized``: only the weights ``install_quantized`` does not replace (norms, biases).

        Raises:
            ValueError: an unknown name, a shape mismatch, or weights missing at the end.
        """
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            dst, transpose = self._weight_slot(name)
            src = tensor.t() if transpose else tensor
            if src.dim() == 1 and dst.dim() == 2 and dst.shape[1:] == src.shape:
                pass  # a per-head norm weight broadcast over its rows of the fused qk_norm
            elif dst.shape != src.shape:
                raise ValueError(
                    f"weights: '{name}' has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(dst.t().shape if transpose else dst.shape)}"
                )
            with torch.no_grad():
                dst.copy_(src)
            loaded.add(name)
        missing = sorted(set(self.expected_weight_names(quantized)) - loaded)
        if missing:
            raise ValueError(
                f"weights: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
            )
        if self.arch.tie_word_embeddings and not quantized:
            with torch.no_grad():
                self.lm_head.copy_(self.embed.t())

    def expected_weight_names(self, quantized: bool = False) -> list[str]:
        """HF names `load_weights` needs (biases and norms only where the arch has them);
        ``quantized``: without the linear weights, the embedding and the LM head."""
        arch = self.arch
        names = ["model.norm.weight"]
        if not quantized:
            names.append("model.embed_tokens.weight")
        if not arch.tie_word_embeddings and not quantized:
            names.append("lm_head.weight")
        per_layer = [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ]
        if arch.attention_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if arch.o_proj_bias:
            per_layer.append("self_attn.o_proj.bias")
        if arch.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        if quantized:
            linear = {part for parts in LINEAR_PARTS.values() for part in parts}
            per_layer = [suffix for suffix in per_layer if suffix not in linear]
        for i in range(arch.num_layers):
            names += [f"model.layers.{i}.{suffix}" for suffix in per_layer]
        return names

    def _weight_slot(self, name: str) -> tuple[torch.Tensor, bool]:
        """Where HF tensor `name` goes: (a view of a parameter, whether to transpose into it)."""
        top = {
            "model.embed_tokens.weight": (self.embed, False),
            "model.norm.weight": (self.norm, False),
            "lm_head.weight": (self.lm_head, True),
        }
        if name in top:
            return top[name]
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            raise ValueError(f"weights: unexpected tensor '{name}'")
        layer_idx = int(parts[2])
        if layer_idx >= len(self.layers):
            raise ValueError(f"weights: '{name}' is past num_layers={len(self.layers)}")
        layer: LlamaDecoderLayer = self.layers[layer_idx]  # type: ignore[assignment]
        q, kv, inter, heads = layer.q_size, layer.kv_size, layer.intermediate_size, layer.num_heads
        slots: dict[str, tuple[torch.Tensor | None, bool]] = {
            "input_layernorm.weight": (layer.input_norm, False),
            "post_attention_layernorm.weight": (layer.post_attention_norm, False),
            "self_attn.q_proj.weight": (layer.qkv_proj[:, :q], True),
            "self_attn.k_proj.weight": (layer.qkv_proj[:, q : q + kv], True),
            "self_attn.v_proj.weight": (layer.qkv_proj[:, q + kv :], True),
            "self_attn.o_proj.weight": (layer.o_proj, True),
            "mlp.gate_proj.weight": (layer.gate_up_proj[:, :inter], True),
            "mlp.up_proj.weight": (layer.gate_up_proj[:, inter:], True),
            "mlp.down_proj.weight": (layer.down_proj, True),
        }
        if layer.qkv_bias is not None:
            slots["self_attn.q_proj.bias"] = (layer.qkv_bias[:q], False)
            slots["self_attn.k_proj.bias"] = (layer.qkv_bias[q : q + kv], False)
            slots["self_attn.v_proj.bias"] = (layer.qkv_bias[q + kv :], False)
        if layer.o_bias is not None:
            slots["self_attn.o_proj.bias"] = (layer.o_bias, False)
        if layer.qk_norm is not None:
            slots["self_attn.q_norm.weight"] = (layer.qk_norm[:heads], False)
            slots["self_attn.k_norm.weight"] = (layer.qk_norm[heads:], False)
        slot = slots.get(".".join(parts[3:]))
        if slot is None or slot[0] is None:
            raise ValueError(f"weights: unexpected tensor '{name}'")
        return slot  # type: ignore[return-value]

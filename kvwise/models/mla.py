"""Multi-head latent attention (DeepSeek-V2/V3): a decoder layer whose KV cache holds one
compressed latent a token, not K and V for every head.

A token's attention input ``x`` gives
- the latent ``c = RMSNorm(x . W_dkv)`` (``kv_lora_rank`` values) and one rotary key ``k_r =
  rope(x . W_kr)`` (``qk_rope_head_dim``) shared by every head: the cached row ``[c | k_r]``;
- each head's query ``[q_n | q_r]`` (``qk_nope_head_dim`` + ``qk_rope_head_dim``; from ``x .
  W_q`` or through a low-rank ``q_a`` / norm / ``q_b`` pair), ``q_r`` rotated.
A head's key is ``[W_uk^h c | k_r]`` and its value ``W_uv^h c`` (``kv_b_proj`` splits into
``W_uk^h`` and ``W_uv^h``). Absorbed, so that attention reads the latent itself: head h's query
becomes ``[q_n W_uk^h | q_r]`` (``kv_lora_rank + qk_rope_head_dim`` wide), its scores against
the cached rows are the expanded ones exactly, and its output over the rows' latents, times
``W_uv^h``, is the expanded value sum. So attention is multi-query attention over one KV head
of ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V2/V3): the paged pool, its formats,
kernels and tiers hold and move the latent as they hold any KV head (``ModelArchConfig``
describes an MLA model's cache as 1 KV head of that width). The value passed is the cached row
too (its last ``qk_rope_head_dim`` outputs are dropped): the pool stores it twice for now.

The softmax scale is the expanded head's, ``(qk_nope + qk_rope) ** -0.5`` times YaRN's mscale
squared (the family's ``attention_kinds``). DeepSeek's rotary pairs neighbouring dimensions
(complex numbers); its rotary columns are reordered once after loading (``after_load``: pairs
to halves, for queries and keys alike, which leaves their dot products unchanged) so that
kvwise's rotate-half rotary applies.

Weights: float, or quantized after loading (``install_quantized``: ``quantization`` "int8" /
"int4" of an HF checkpoint): the query, latent and output projections, the dense MLP and every
expert (``MoEWeights.install_quantized``); ``kv_b_proj`` stays float (the absorbed query and
the value expansion read it per head, ``w_uk`` / ``w_uv`` once loaded; 2 M values a DeepSeek-V2
layer). Every matmul is ``float_mm`` or a quantized weight's: a row's bits do not depend on the
batch.
"""

from __future__ import annotations

import torch
from torch import nn

from kvwise.models.arch import ModelArchConfig
from kvwise.models.family import ModelFamily
from kvwise.models.layers import GLUS, NORMS, apply_rope
from kvwise.models.linear import float_mm, param
from kvwise.models.moe import MoEWeights

# the projections install_quantized quantizes (those the layer has)
_LINEAR = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "o_proj", "gate_up_proj", "down_proj")


class MLALayer(nn.Module):
    """One DeepSeek decoder layer: latent attention, then a dense MLP or a mixture of experts
    (see the module docstring). Weights ``[in, out]`` as the decoder's."""

    def __init__(
        self, arch: ModelArchConfig, family: type[ModelFamily], dtype: torch.dtype, moe: bool
    ) -> None:
        super().__init__()
        hidden, heads = arch.hidden_size, arch.num_heads
        self.family, self.eps, self.heads = family, arch.rms_norm_eps, heads
        self.nope, self.rope = arch.qk_nope_head_dim, arch.qk_rope_head_dim
        self.rank, self.v_dim = arch.kv_lora_rank, arch.v_head_dim
        self.norm = NORMS[family.norm]
        q_width = heads * (self.nope + self.rope)
        self.input_norm = param(hidden, dtype=dtype)
        self.q_proj = None if arch.q_lora_rank else param(hidden, q_width, dtype=dtype)
        self.q_a_proj = param(hidden, arch.q_lora_rank, dtype=dtype) if arch.q_lora_rank else None
        self.q_a_norm = param(arch.q_lora_rank, dtype=dtype) if arch.q_lora_rank else None
        self.q_b_proj = param(arch.q_lora_rank, q_width, dtype=dtype) if arch.q_lora_rank else None
        self.kv_a_proj = param(hidden, self.rank + self.rope, dtype=dtype)  # [in, c | k_r]
        self.kv_a_norm = param(self.rank, dtype=dtype)
        self.kv_b_proj = param(self.rank, heads * (self.nope + self.v_dim), dtype=dtype)
        # kv_b_proj per head once loaded (after_load): W_uk^h (nope, rank), W_uv^h (rank, v)
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None
        self.o_proj = param(heads * self.v_dim, hidden, dtype=dtype)
        self.mlp_norm = param(hidden, dtype=dtype)
        inter = arch.intermediate_size
        self.moe = MoEWeights(arch, dtype) if moe else None
        self.gate_up_proj = None if moe else param(hidden, 2 * inter, dtype=dtype)
        self.down_proj = None if moe else param(inter, hidden, dtype=dtype)
        self.inter = inter
        self.glu = GLUS[family.activation]
        self.quant: dict | None = None  # _LINEAR name -> quantized weight, once installed
        self.sinks = None

    def slots(self) -> dict[str, tuple[torch.Tensor | None, bool]]:
        """The HF tensor names of this layer's own weights -> (view, transpose)."""
        inter, attn = self.inter, "self_attn."
        slots = {
            "input_layernorm.weight": (self.input_norm, False),
            "post_attention_layernorm.weight": (self.mlp_norm, False),
            attn + "kv_a_proj_with_mqa.weight": (self.kv_a_proj, True),
            attn + "kv_a_layernorm.weight": (self.kv_a_norm, False),
            attn + "kv_b_proj.weight": (self.kv_b_proj, True),
            attn + "o_proj.weight": (self.o_proj, True),
        }
        if self.q_proj is not None:
            slots[attn + "q_proj.weight"] = (self.q_proj, True)
        else:
            slots[attn + "q_a_proj.weight"] = (self.q_a_proj, True)
            slots[attn + "q_a_layernorm.weight"] = (self.q_a_norm, False)
            slots[attn + "q_b_proj.weight"] = (self.q_b_proj, True)
        if self.moe is None:
            slots["mlp.gate_proj.weight"] = (self.gate_up_proj[:, :inter], True)
            slots["mlp.up_proj.weight"] = (self.gate_up_proj[:, inter:], True)
            slots["mlp.down_proj.weight"] = (self.down_proj, True)
        return slots

    @torch.no_grad()
    def after_load(self) -> None:
        """DeepSeek's rotary pairs (2i, 2i + 1) -> halves (i, i + rope / 2) in the query's and
        the shared key's rotary columns (see the module docstring)."""
        order = torch.cat((torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)))
        q = self.q_proj if self.q_proj is not None else self.q_b_proj
        heads = q.view(q.shape[0], self.heads, self.nope + self.rope)
        heads[..., self.nope :] = heads[..., self.nope :][..., order]
        self.kv_a_proj[:, self.rank :] = self.kv_a_proj[:, self.rank :][:, order]
        up = self.kv_b_proj.view(self.rank, self.heads, self.nope + self.v_dim)
        w_uk = up[..., : self.nope].permute(1, 2, 0).contiguous()  # (H, nope, rank)
        w_uv = up[..., self.nope :].permute(1, 0, 2).contiguous()  # (H, rank, v)
        self.w_uk = nn.Parameter(w_uk, requires_grad=False)  # weights: counted, moved
        self.w_uv = nn.Parameter(w_uv, requires_grad=False)
        self.kv_b_proj = None  # held per head instead

    def install_quantized(self, quantize) -> None:
        """Quantize the projections ``quantize`` takes (a float ``(out, in)`` weight -> a
        weight with ``mm``) but ``kv_b_proj``; their float parameters go."""
        self.quant = {}
        for name in _LINEAR:
            weight = getattr(self, name)
            if weight is not None:
                self.quant[name] = quantize(weight.t())
                setattr(self, name, None)
        if self.moe is not None:
            self.moe.install_quantized(quantize)

    def _mm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x`` times projection ``name`` (float32 out)."""
        if self.quant is not None and name in self.quant:
            return self.quant[name].mm(x).float()
        return float_mm(x, getattr(self, name))

    @staticmethod
    def _per_head(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``(T, H, a)`` times each head's ``weights[h]`` ``(a, b)`` -> ``(T, H, b)``, a
        ``float_mm`` a head (a row's bits never depend on the batch)."""
        return torch.stack(
            [float_mm(x[:, h].contiguous(), weights[h]) for h in range(len(weights))], dim=1
        )

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_a_norm is None:
            return self._mm(x, "q_proj")
        low = self.norm(self._mm(x, "q_a_proj"), self.q_a_norm, self.eps)
        return self._mm(low, "q_b_proj")

    def forward(self, layer_idx, residual, rope_cos, rope_sin, attn) -> torch.Tensor:
        """Update ``residual`` ``(T, hidden)`` in place with the attention's and the MLP's
        outputs (the decoder's step for this layer)."""
        tokens = residual.shape[0]
        x = self.norm(residual, self.input_norm, self.eps)
        q = self._query(x).view(tokens, self.heads, self.nope + self.rope)
        kv = self._mm(x, "kv_a_proj")  # (T, rank + rope)
        latent = self.norm(kv[:, : self.rank], self.kv_a_norm, self.eps)  # (T, rank)
        k_rope = apply_rope(kv[:, None, self.rank :], rope_cos, rope_sin)  # (T, 1, rope)
        q_rope = apply_rope(q[..., self.nope :], rope_cos, rope_sin)  # (T, H, rope)
        q_latent = self._per_head(q[..., : self.nope], self.w_uk)  # (T, H, rank)
        query = torch.cat((q_latent, q_rope), dim=-1)  # (T, H, rank + rope)
        row = torch.cat((latent[:, None], k_rope), dim=-1)  # (T, 1, rank + rope)
        out = attn(layer_idx, query, row, row).view(tokens, self.heads, -1)[..., : self.rank]
        values = self._per_head(out, self.w_uv)  # (T, H, v)
        residual.add_(self._mm(values.reshape(tokens, -1).contiguous(), "o_proj"))
        x = self.norm(residual, self.mlp_norm, self.eps)
        if self.moe is not None:
            residual.add_(self.moe(x, self.glu))
        else:
            gate = self.glu(self._mm(x, "gate_up_proj"), self.inter)
            residual.add_(self._mm(gate.contiguous(), "down_proj"))
        return residual

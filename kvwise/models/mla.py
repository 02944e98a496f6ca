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
kvwise's rotate-half rotary applies. Float weights (``quantization="none"``) only, for now.
"""

from __future__ import annotations

import torch
from torch import nn

from kvwise.models.arch import ModelArchConfig
from kvwise.models.family import ModelFamily
from kvwise.models.layers import NORMS, apply_rope
from kvwise.models.linear import float_mm, param
from kvwise.models.moe import MoEWeights

AttnFn = object  # (layer, q, k, v) -> (T, heads * width); decoder.AttentionFn


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
        self.o_proj = param(heads * self.v_dim, hidden, dtype=dtype)
        self.mlp_norm = param(hidden, dtype=dtype)
        inter = arch.intermediate_size
        self.moe = MoEWeights(arch, dtype) if moe else None
        self.gate_up_proj = None if moe else param(hidden, 2 * inter, dtype=dtype)
        self.down_proj = None if moe else param(inter, hidden, dtype=dtype)
        self.inter = inter
        self.glu = None  # the family's, set by the decoder
        self.quant = None  # float weights only (see the module docstring)
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

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return float_mm(x, self.q_proj)
        low = self.norm(float_mm(x, self.q_a_proj), self.q_a_norm, self.eps)
        return float_mm(low, self.q_b_proj)

    def forward(self, layer_idx, residual, rope_cos, rope_sin, attn) -> torch.Tensor:
        """Update ``residual`` ``(T, hidden)`` in place with the attention's and the MLP's
        outputs (the decoder's step for this layer)."""
        tokens = residual.shape[0]
        x = self.norm(residual, self.input_norm, self.eps)
        q = self._query(x).view(tokens, self.heads, self.nope + self.rope)
        kv = float_mm(x, self.kv_a_proj)  # (T, rank + rope)
        latent = self.norm(kv[:, : self.rank], self.kv_a_norm, self.eps)  # (T, rank)
        k_rope = apply_rope(kv[:, None, self.rank :], rope_cos, rope_sin)  # (T, 1, rope)
        q_rope = apply_rope(q[..., self.nope :], rope_cos, rope_sin)  # (T, H, rope)
        up = self.kv_b_proj.view(self.rank, self.heads, self.nope + self.v_dim)
        q_latent = torch.einsum("thn,chn->thc", q[..., : self.nope], up[..., : self.nope])
        query = torch.cat((q_latent, q_rope), dim=-1)  # (T, H, rank + rope)
        row = torch.cat((latent[:, None], k_rope), dim=-1)  # (T, 1, rank + rope)
        out = attn(layer_idx, query, row, row).view(tokens, self.heads, -1)[..., : self.rank]
        values = torch.einsum("thc,chv->thv", out, up[..., self.nope :])  # (T, H, v)
        residual.add_(float_mm(values.reshape(tokens, -1).contiguous(), self.o_proj))
        x = self.norm(residual, self.mlp_norm, self.eps)
        if self.moe is not None:
            residual.add_(self.moe(x, self.glu))
        else:
            residual.add_(
                float_mm(self.glu(float_mm(x, self.gate_up_proj), self.inter), self.down_proj)
            )
        return residual

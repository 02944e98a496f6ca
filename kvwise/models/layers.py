"""Stateless building blocks of the decoder: the RMSNorms, the GLU activations, rotary tables,
the logit soft cap, reference attention (and attention with soft-capped scores, which SDPA
cannot compute). A family names its norm and activation
(``models/family.py``); ``NORMS`` and ``GLUS`` map those names onto these functions.

Rotary uses the Hugging Face "rotate_half" (non-interleaved) convention: a head vector's first
half pairs with its second half. GGUF q/k weights, permuted for llama.cpp's interleaved rope, are
un-permuted by the loader, so this is the only convention the model needs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvwise.models.arch import RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back (as HF does) before the weight.

    `weight` must broadcast against `x`; its shape may cover more than the last dim (the fused
    per-head q/k norm passes a `(num_heads + num_kv_heads, head_dim)` weight).
    """
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def rms_norm_one_plus(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by ``1 + weight`` (Gemma's), computed in fp32 and cast back after the
    weight (as HF's GemmaRMSNorm does). `weight` broadcasts as in ``rms_norm``."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def silu_glu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """`(T, 2 * inter)` [gate | up] -> `(T, inter)` silu(gate) * up, into gate_up's first half."""
    gate = F.silu(gate_up[:, :inter], inplace=True)  # (T, inter), a view
    return gate.mul_(gate_up[:, inter:])


def gelu_tanh_glu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """`(T, 2 * inter)` [gate | up] -> `(T, inter)` gelu_tanh(gate) * up (GeGLU, Gemma's)."""
    gate = F.gelu(gate_up[:, :inter], approximate="tanh")  # (T, inter)
    return gate.mul_(gate_up[:, inter:])


# a family's ``norm`` and ``activation`` names -> the functions (models/family.py)
NORMS = {"rms": rms_norm, "rms_one_plus": rms_norm_one_plus}
GLUS = {"silu": silu_glu, "gelu_tanh": gelu_tanh_glu}


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)``, in place (Gemma's final-logit soft-capping)."""
    return logits.div_(cap).tanh_().mul_(cap)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies `(head_dim // 2,)` in fp32, matching transformers' rope init functions."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # (D/2,)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    # llama3: transformers' `_compute_llama3_parameters`, step for step.
    factor = scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies: transformers' ``_compute_yarn_parameters``, step for step."""

    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # the share of a dimension's original frequency
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


def rope_table(
    max_positions: int, head_dim: int, theta: float, scaling: RopeScaling | None
) -> torch.Tensor:
    """Rotary table `(max_positions, 2, head_dim)` in fp32: `[:, 0]` is cos, `[:, 1]` is a signed sin.

    The sin row is `cat(-sin, sin)` so that `rotate_half(x) * sin == roll(x, D/2) * signed_sin`,
    which saves the negation per layer (negation is exact, so results are unchanged).
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling)  # (D/2,)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2)
    cos = torch.cat((freqs, freqs), dim=-1).cos()  # (P, D)
    sin = freqs.sin()  # (P, D/2)
    if scaling is not None and scaling.attention_factor is not None:  # YaRN's
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    signed_sin = torch.cat((-sin, sin), dim=-1)  # (P, D)
    return torch.stack((cos, signed_sin), dim=1)  # (P, 2, D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `(T, n_heads, D)` by per-token tables `cos`, `signed_sin` `(T, 1, D)`."""
    rotated = torch.roll(x, x.shape[-1] // 2, dims=-1)  # (T, n, D): cat(x2, x1)
    return torch.addcmul(x * cos, rotated, signed_sin)  # (T, n, D)


def softcapped_attention(
    q: torch.Tensor,  # (B, num_heads, n, head_dim)
    k: torch.Tensor,  # (B, kv_heads, L, head_dim)
    v: torch.Tensor,  # (B, kv_heads, L, head_dim)
    scale: float,
    softcap: float | None,
    mask: torch.Tensor | None = None,  # bool, broadcasts to (B, num_heads, n, L); True: attend
    is_causal: bool = False,
    sinks: torch.Tensor | None = None,  # (num_heads,)
) -> torch.Tensor:
    """SDPA's attention (GQA, a bool mask or ``is_causal``), its scores computed explicitly:
    every score soft-capped after the scale, ``softcap * tanh(score / softcap)``, before the
    mask and the softmax (as transformers' Gemma 2 eager attention computes it; None: no cap);
    with ``sinks``, head h's logit ``sinks[h]`` joins each softmax as one more column that
    adds no value (gpt-oss's eager attention). Returns ``(B, num_heads, n, head_dim)``."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)  # (B, num_heads, L, head_dim)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, num_heads, n, L)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, column), dim=-1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        weights = weights[..., :-1]
    return torch.matmul(weights, v)


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference causal attention for ONE sequence (tests, debugging).

    Args:
        q: `(T_q, num_heads, head_dim)`, the last `T_q` tokens of the sequence.
        k, v: `(T_k, num_kv_heads, head_dim)` with `T_k >= T_q`: every token so far, in order.
        scale: softmax scale; default `head_dim ** -0.5`.
        sliding_window: if set, a query at position p sees only keys at `p - window < pos <= p`
            (HF Mistral/Qwen2 semantics).
        softcap: if set, every score soft-capped, ``softcap * tanh(score / softcap)``, before
            the softmax (Gemma 2's attn_logit_softcapping).
        sinks: if set, `(num_heads,)` logits that join each head's softmax (gpt-oss).

    Returns:
        `(T_q, num_heads * head_dim)`; query i attends to keys `0 .. T_k - T_q + i`.
    """
    num_q, num_heads, head_dim = q.shape
    num_k = k.shape[0]
    if num_k < num_q:
        raise ValueError(f"k: need at least as many keys ({num_k}) as queries ({num_q})")
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, T, D)
    if num_q == num_k and sliding_window is None and softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True
        )  # (H, T_q, D)
    else:
        q_pos = torch.arange(num_q, device=q.device)[:, None] + (num_k - num_q)  # (T_q, 1)
        k_pos = torch.arange(num_k, device=q.device)[None, :]  # (1, T_k)
        mask = k_pos <= q_pos  # (T_q, T_k)
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        if softcap is not None or sinks is not None:
            out = softcapped_attention(
                qh[None],
                kh[None],
                vh[None],
                head_dim**-0.5 if scale is None else scale,
                softcap,
                mask,
                sinks=sinks,
            )[0]
        else:
            out = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True
            )  # (H, T_q, D)
    return out.transpose(0, 1).reshape(num_q, num_heads * head_dim)  # (T_q, H*D)

"""The shape of a decoder model: what the model code and the KV cache need to know.

`ModelArchConfig` is built from a Hugging Face ``config.json`` dict or from a GGUF file's
metadata by ``models/arch_load.py`` (through the registered families, ``models/registry.py``:
the family says how its config.json sets the per-checkpoint flags, ``ModelFamily.hf_flags``).
It imports no torch, so the engine core can size its KV cache from it without loading weights,
and nothing of the families (they take it), so it is the bottom of ``models``.
Supported: Llama (SmolLM2, Llama 2/3), Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm),
Gemma 2 and Gemma 3 text models (``models/gemma.py``: local and global layers, q/k norm for 3),
and the mixture-of-experts Qwen2-MoE, Qwen3-MoE and Mixtral (``models/moe_families.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names, config.json layer_types
ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_topk")  # ModelArchConfig.routing
EXPERT_GLUS = ("", "swiglu_clamped")  # ModelArchConfig.expert_glu


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are rescaled for long context.

    rope_type:
        "linear": every inverse frequency is divided by `factor`.
        "llama3": Llama 3.1 band-wise scaling (needs the low/high factors and the original length).
        "freq_factors": inverse frequency i is divided by `freq_factors[i]` (llama.cpp's
            ``rope_freqs`` tensor, the form in which GGUF files carry Llama 3.1 scaling).
        "yarn": YaRN (gpt-oss, DeepSeek): each frequency between its extrapolated and its
            interpolated (divided by `factor`) value by a linear ramp over the dimensions
            whose wavelengths fall between `beta_fast` and `beta_slow` rotations of the original
            length (ends rounded outwards where `truncate`), and cos / sin scaled by
            `attention_factor` (None: ``0.1 ln(factor) + 1``, or DeepSeek's ratio of two such
            terms with `mscale` / `mscale_all_dim`), as transformers computes them.
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    freq_factors: tuple[float, ...] | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale_all_dim: float = 0.0  # DeepSeek: YaRN's mscale on the softmax scale too

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3", "freq_factors", "yarn"):
            raise ValueError(
                f"rope_scaling: unsupported rope type '{self.rope_type}'; "
                "supported: default, linear, llama3, yarn"
            )
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("rope_scaling: yarn needs original_max_position_embeddings")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if (
                self.low_freq_factor is None
                or self.high_freq_factor is None
                or self.original_max_position_embeddings is None
            ):
                raise ValueError(
                    "rope_scaling: llama3 needs low_freq_factor, high_freq_factor and "
                    "original_max_position_embeddings"
                )
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("rope_scaling.high_freq_factor must be > low_freq_factor")
        if self.rope_type == "freq_factors" and not self.freq_factors:
            raise ValueError("rope_scaling.freq_factors must be a non-empty tuple")

    @classmethod
    def from_hf(
        cls, params: dict[str, Any] | None, max_position_embeddings: int
    ) -> RopeScaling | None:
        """Parse HF ``rope_scaling`` / ``rope_parameters``; None for plain (default) rope."""
        if not params:
            return None
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type == "linear":
            return cls("linear", factor=float(params["factor"]))
        if rope_type == "llama3":
            return cls(
                "llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings", max_position_embeddings)
                ),
            )
        if rope_type == "yarn":
            return cls._yarn(params, max_position_embeddings)
        raise ValueError(
            f"rope_scaling: unsupported rope type '{rope_type}'; "
            "supported: default, linear, llama3, yarn"
        )

    @classmethod
    def _yarn(cls, params: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
        original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
        factor = params.get("factor") or max_position_embeddings / original
        attention = params.get("attention_factor")
        if attention is None:  # transformers' yarn_get_mscale
            mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")

            def get_mscale(m: float) -> float:
                return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

            attention = get_mscale(mscale) / get_mscale(all_dim) if mscale and all_dim else None
            attention = attention if attention is not None else get_mscale(1.0)
        return cls(
            "yarn",
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(attention),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )


@dataclass(frozen=True)
class ModelArchConfig:
    """Hyper-parameters of a decoder of a registered family. Sizes are counts, not bytes.

    architecture: an HF architecture name (its family: ``registry.family_for``, which refuses
        an unregistered one; so do the loaders of ``arch_load``).
    attention_bias: q/k/v projections have a bias (Qwen2; Llama/Qwen3 when configured).
    o_proj_bias: the output projection has a bias (Llama/Qwen3 with attention_bias=True).
    qk_norm: per-head RMSNorm on q and k before rotary (Qwen3).
    sliding_window: recorded only (Mistral, Qwen2 with use_sliding_window, Gemma's local
        layers), in each layer's ``AttentionKind``; the model does not apply it — the
        attention function owns masking.
    layer_types: per layer "sliding_attention" (the window) or "full_attention" (none), HF's
        names; empty: every layer alike (the window, if any, on all).
    sliding_rope_theta: the rotary base of the sliding layers where it is not ``rope_theta``
        (Gemma 3's rope_local_base_freq; those layers are then unscaled); None: the same.
    query_pre_attn_scalar: the softmax scale is its ``** -0.5`` (Gemma); None: head_dim's.
    final_logit_softcap: ``cap * tanh(logits / cap)`` on the final logits (Gemma 2); None.
    attn_logit_softcap: ``cap * tanh(score / cap)`` on every attention score, after the scale
        and before the softmax (Gemma 2's attn_logit_softcapping); None: none.

    Mixture of experts (``models/moe.py``; 0 experts: every layer's MLP dense):
    num_experts, num_experts_per_tok: the routed experts and how many each token runs.
    moe_intermediate_size: one expert's hidden size (``intermediate_size`` stays the dense
        MLP's, for ``dense_layers``).
    norm_topk_prob: the chosen experts' router probabilities renormalised to sum to 1.
    shared_expert_intermediate_size: an expert every token runs besides its routed ones (0:
        none); shared_expert_gate: its output scaled by ``sigmoid(x . g)`` (Qwen2-MoE).
    dense_layers: layers of a MoE model whose MLP is dense (Qwen's ``mlp_only_layers``).
    routing: "softmax_topk" (softmax over every expert, then the top k: Mixtral, Qwen,
        DeepSeek-V2), "topk_softmax" (the top k router logits, then a softmax over those:
        gpt-oss) or "sigmoid_topk" (sigmoid scores, the top k of them plus a learned
        correction bias, weighted by the scores without it: DeepSeek-V3).
    n_group, topk_group: group-limited routing (DeepSeek): the experts in ``n_group`` groups,
        each token's top k taken within its ``topk_group`` best groups (a group's score: its
        best expert's score under softmax, its best two's sum under sigmoid); 1, 1: none.
    routed_scaling_factor: the routed experts' weights times this (DeepSeek).
    router_correction_bias: "sigmoid_topk"'s per-expert bias on the scores that choose.
    router_bias, expert_bias: the router's logits, and each expert's gate/up and down
        projections, have biases (gpt-oss).
    expert_glu: the experts' gate: "" the family's activation; "swiglu_clamped" gpt-oss's
        ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, l)``, with
        ``swiglu_alpha``, ``swiglu_limit`` = alpha, l.
    attention_sinks: each query head has a learned logit that joins every softmax's
        denominator and adds no value (gpt-oss's ``sinks``).

    Multi-head latent attention (DeepSeek; ``models/mla.py``; ``kv_lora_rank`` 0: none): the
    cache holds one latent of ``kv_lora_rank`` and a shared rotary key of ``qk_rope_head_dim``
    a token, so ``num_kv_heads`` is 1 and ``head_dim`` their sum (the cache's row);
    ``q_lora_rank`` (0: none) the queries' low rank, ``qk_nope_head_dim`` / ``v_head_dim`` a
    head's unrotated query/key and value widths.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    dense_layers: tuple[int, ...] = ()
    routing: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_correction_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    expert_glu: str = ""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_sinks: bool = False
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ValueError(f"architecture must be a name, got {self.architecture!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be None or > 0, got {self.sliding_window}")
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError("eos_token_ids must be a tuple of ints")
        self._check_layer_types()
        self._check_experts()
        self._check_latent()
        for name in (
            "sliding_rope_theta",
            "query_pre_attn_scalar",
            "final_logit_softcap",
            "attn_logit_softcap",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be None or > 0, got {value!r}")
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "freq_factors":
            if len(scaling.freq_factors or ()) != self.head_dim // 2:
                raise ValueError(
                    f"rope_scaling.freq_factors must have head_dim/2 = {self.head_dim // 2} entries"
                )

    def _check_layer_types(self) -> None:
        if not isinstance(self.layer_types, tuple):
            raise ValueError("layer_types must be a tuple of str")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types: {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        odd = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if odd:
            raise ValueError(f"layer_types: unsupported {odd}; supported: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types: sliding_attention layers need a sliding_window")

    def _check_experts(self) -> None:
        if not self.num_experts:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: expected 1..{self.num_experts}, "
                f"got {self.num_experts_per_tok!r}"
            )
        if not isinstance(self.moe_intermediate_size, int) or self.moe_intermediate_size <= 0:
            raise ValueError(
                f"moe_intermediate_size must be a positive int, got {self.moe_intermediate_size!r}"
            )
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate: needs a shared expert")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers: expected layers 0..{self.num_layers - 1}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing: expected one of {ROUTINGS}, got {self.routing!r}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"n_group: {self.n_group!r} does not divide {self.num_experts} experts"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group: expected 1..{self.n_group}, got {self.topk_group!r}")
        if self.expert_glu not in EXPERT_GLUS:
            raise ValueError(f"expert_glu: expected one of {EXPERT_GLUS}, got {self.expert_glu!r}")
        if self.expert_glu and not (self.swiglu_alpha > 0 and self.swiglu_limit > 0):
            raise ValueError("swiglu_alpha and swiglu_limit must be > 0")

    def _check_latent(self) -> None:
        if not self.kv_lora_rank:
            return
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"{name} must be > 0 with kv_lora_rank, got {getattr(self, name)!r}"
                )
        if (self.num_kv_heads, self.head_dim) != (1, self.kv_lora_rank + self.qk_rope_head_dim):
            raise ValueError(
                "kv_lora_rank: the cache of latent attention is 1 KV head of kv_lora_rank + "
                f"qk_rope_head_dim = {self.kv_lora_rank + self.qk_rope_head_dim}"
            )

    @property
    def rope_dim(self) -> int:
        """The rotary dimensions of a head (MLA: the shared rotary key's)."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def replace(self, **changes: Any) -> ModelArchConfig:
        return dataclasses.replace(self, **changes)

"""Gemma 2 and Gemma 3 (text): the one decoder step with Gemma's choices declared.

Where Gemma differs from Llama (HF's ``modeling_gemma2.py`` / ``modeling_gemma3.py``): every
RMSNorm scales by ``1 + w`` in float32 and casts after the weight; four norms a layer (the
attention and MLP outputs are normed before their residual adds); a GeGLU MLP with tanh GELU;
the embedded tokens times sqrt(hidden), that factor rounded to float32 and then to the model's
dtype as HF rounds it; tied embeddings; local (sliding-window) and global layers from
``layer_types`` (else Gemma 2: every other layer local, from layer 0; Gemma 3: five local to one
global); the softmax scale ``query_pre_attn_scalar ** -0.5``. Gemma 2 soft-caps the final
logits and every layer's attention scores (``attn_logit_softcapping``, 50.0 in every released
Gemma 2 and llama.cpp's default for a gemma2 GGUF; the attention backend applies it, each
layer's ``AttentionKind.softcap``); Gemma 3 has a q/k norm and its own rotary base on the local
layers (rope_local_base_freq, 10,000; 1,000,000 on the global ones, which alone take
rope_scaling), and soft-caps its attention only where its config says so (transformers'
default: none).

Refused, naming the field: bidirectional attention and a scaled rotary on the local layers.
The multimodal
``Gemma3ForConditionalGeneration`` (model_type "gemma3") is not registered; a gemma3 GGUF holds
its text model only and loads.

GGUF: llama.cpp's converter stores every norm weight plus 1 (``gguf_norm_offset``, taken off
again by the loader); the metadata gives the window, the layer pattern (an int or one flag a
layer), the global base (``rope.freq_base``; the local one, ``rope.freq_base_swa``, is usually
absent: 10,000, as llama.cpp assumes) and no query_pre_attn_scalar: llama.cpp's rule stands in
(hidden / heads for the 27B models, else head_dim). Pure Python (no torch).
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar

from kvwise.models.arch import ModelArchConfig, RopeScaling
from kvwise.models.family import GGUFGetter, ModelFamily

_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp: these scale by hidden / heads


class GemmaFamily(ModelFamily):
    """What Gemma 2 and 3 share; each registers as its own subclass, which sets the defaults
    (transformers' where a config.json omits a field; llama.cpp's where a GGUF does)."""

    hf_activations = ("gelu_pytorch_tanh",)
    norm = "rms_one_plus"
    activation = "gelu_tanh"
    post_norms = True
    norm_names = {
        "input_norm": "input_layernorm.weight",
        "attn_out_norm": "post_attention_layernorm.weight",
        "mlp_norm": "pre_feedforward_layernorm.weight",
        "mlp_out_norm": "post_feedforward_layernorm.weight",
    }
    gguf_norm_offset = 1.0
    gguf_name: ClassVar[str] = ""  # its general.architecture
    has_qk_norm: ClassVar[bool] = False
    layer_pattern: ClassVar[int] = 2  # every n-th layer global, the others local
    final_softcap: ClassVar[float | None] = None  # final_logit_softcapping
    attn_softcap: ClassVar[float | None] = None  # attn_logit_softcapping
    gguf_window: ClassVar[int | None] = None  # where a GGUF names no sliding window

    @classmethod
    def embedding_scale(cls, arch: ModelArchConfig) -> float:
        # HF: torch.tensor(sqrt(hidden)) (float32), then .to(the weights' dtype)
        return struct.unpack("f", struct.pack("f", arch.hidden_size**0.5))[0]

    @classmethod
    def hf_flags(cls, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        _refuse("use_bidirectional_attention", config.get("use_bidirectional_attention"))
        bias = bool(config.get("attention_bias", False))
        types = config.get("layer_types")
        if types is None:
            pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
            types = _pattern_types(pattern or cls.layer_pattern, int(config["num_hidden_layers"]))
        cap = config.get("final_logit_softcapping", cls.final_softcap)
        attn_cap = config.get("attn_logit_softcapping", cls.attn_softcap)
        return dict(
            attention_bias=bias,
            o_proj_bias=bias,
            qk_norm=cls.has_qk_norm,
            sliding_window=config.get("sliding_window", 4096),
            layer_types=tuple(types),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
            final_logit_softcap=None if cap is None else float(cap),
            attn_logit_softcap=None if attn_cap is None else float(attn_cap),
        )

    @classmethod
    def gguf_flags(cls, get: GGUFGetter, fields: dict[str, Any]) -> dict[str, Any]:
        num_layers = fields["num_layers"]
        window = get("attention.sliding_window", cls.gguf_window) or None
        pattern = get("attention.sliding_window_pattern", cls.layer_pattern)
        per_head = fields["hidden_size"] // fields["num_heads"]
        scalar = per_head if num_layers == _27B_LAYERS[cls.gguf_name] else fields["head_dim"]
        cap = get("final_logit_softcapping", cls.final_softcap)
        return dict(
            sliding_window=window,
            layer_types=_pattern_types(pattern, num_layers) if window else (),
            query_pre_attn_scalar=float(scalar),
            final_logit_softcap=float(cap) if cap else None,  # llama.cpp: 0 is none
        )


class Gemma2Family(GemmaFamily):
    """Gemma 2: final-logit soft-capping, one rotary for every layer, no q/k norm."""

    architectures = ("Gemma2ForCausalLM",)
    hf_model_types = {"gemma2": "Gemma2ForCausalLM"}
    gguf_architectures = {"gemma2": "Gemma2ForCausalLM"}
    gguf_name = "gemma2"
    layer_pattern = 2
    final_softcap = 30.0
    attn_softcap = 50.0
    gguf_window = 4096

    @classmethod
    def gguf_flags(cls, get: GGUFGetter, fields: dict[str, Any]) -> dict[str, Any]:
        base = get("rope.freq_base_swa")
        attn_cap = get("attn_logit_softcapping", cls.attn_softcap)
        flags = super().gguf_flags(get, fields)
        return dict(
            flags,
            sliding_rope_theta=None if base is None else float(base),
            attn_logit_softcap=float(attn_cap) if attn_cap else None,  # 0: none
        )


class Gemma3Family(GemmaFamily):
    """Gemma 3: q/k norm, local layers on their own rotary base."""

    architectures = ("Gemma3ForCausalLM",)
    hf_model_types = {"gemma3_text": "Gemma3ForCausalLM"}
    gguf_architectures = {"gemma3": "Gemma3ForCausalLM"}
    gguf_name = "gemma3"
    has_qk_norm = True
    layer_pattern = 6

    @classmethod
    def hf_flags(cls, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        return dict(super().hf_flags(architecture, config), **_gemma3_rope(config))

    @classmethod
    def gguf_flags(cls, get: GGUFGetter, fields: dict[str, Any]) -> dict[str, Any]:
        flags = super().gguf_flags(get, fields)
        local = get("rope.freq_base_swa", 10000.0) if flags["sliding_window"] else None
        return dict(flags, sliding_rope_theta=None if local is None else float(local))


def _refuse(name: str, value: Any) -> None:
    """Raises ValueError naming ``name`` where ``value`` asks for what kvwise's attention does
    not do (it is causal)."""
    if value:
        raise ValueError(f"{name}: {value!r} is not supported (kvwise's attention is causal)")


def _pattern_types(pattern: int | list, num_layers: int) -> tuple[str, ...]:
    """HF's layer_types from a sliding-window pattern: one flag a layer (GGUF), or every
    ``pattern``-th layer global, the others local (``pattern`` 1: every layer global)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(
                f"sliding_window_pattern: {len(pattern)} flags for {num_layers} layers"
            )
        return tuple("sliding_attention" if p else "full_attention" for p in pattern)
    pattern = int(pattern)
    return tuple(
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    )


def _gemma3_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The global and local rotary of a Gemma 3 config.json: transformers 5 nests them in
    rope_parameters (by layer type); 4.x writes rope_theta, rope_local_base_freq and
    rope_scaling (the global layers')."""
    max_pos = int(config.get("max_position_embeddings", 131072))
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
    else:
        full = dict(params or config.get("rope_scaling") or {})
        full.setdefault("rope_theta", config.get("rope_theta", 1e6))
        local = {"rope_theta": config.get("rope_local_base_freq", 1e4)}
    if RopeScaling.from_hf(local, max_pos) is not None:
        raise ValueError(
            "rope_parameters.sliding_attention: only default rope is supported on "
            f"the local layers, got {local!r}"
        )
    return dict(
        rope_theta=float(full.get("rope_theta") or 1e6),
        rope_scaling=RopeScaling.from_hf(full, max_pos),
        sliding_rope_theta=float(local.get("rope_theta") or 1e4),
    )

"""Model families: what a decoder family computes differently from the one decoder step.

Every supported model runs the same step (``models/decoder.py``): embed, then per layer
norm -> q/k/v -> (q/k norm) -> rotary -> attention -> output projection -> residual, norm ->
gated MLP -> residual, then a final norm and the LM head. A family is a small class that
declares where its models differ from that outline; the decoder, its weight formats
(``models/layer_ops.py``) and the loader read the declaration once, when the model is built:

- ``norm``: every RMSNorm of the model, ``"rms"`` (``w * x_hat``) or ``"rms_one_plus"``
  (``(1 + w) * x_hat``, Gemma's, computed in float32 and cast back);
- ``activation``: the gate of the GLU MLP, ``"silu"`` or ``"gelu_tanh"``;
- ``post_norms``: an extra norm on the attention output and on the MLP output, each before
  its residual add (Gemma 2/3: four norms a layer);
- ``embedding_scale``: a factor on the embedded tokens (Gemma: sqrt(hidden)), or None;
- ``logit_softcap``: ``cap * tanh(logits / cap)`` on the final logits, or None;
- ``attention_kinds``: per layer, the attention it runs (full or a sliding window of W
  tokens, its rotary base and scaling, its softmax scale, a soft cap on its scores): see
  ``AttentionKind``; by default read from the config (``ModelArchConfig.layer_types``,
  ``sliding_rope_theta``, ``query_pre_attn_scalar``, ``attn_logit_softcap``);
- the HF tensor names of its weights (``norm_names``, ``linear_parts``, ...), which the
  loader maps onto the fused parameters (a GGUF's tensors are renamed onto the same slots:
  ``models/gguf_weights.py``), and ``gguf_norm_offset``, what llama.cpp added to its norms;
- ``hf_flags`` / ``gguf_flags``: the per-checkpoint fields its config.json / GGUF metadata set
  (q/k/v biases, q/k norm, the sliding window and which layers use it, ...), and
  ``hf_activations``: the config's names for its activation.

Biases and the q/k norm stay per checkpoint (``ModelArchConfig`` flags, set by ``hf_flags``):
within the Llama family Qwen2 has q/k/v biases and Qwen3 a q/k norm. A family whose choices
are not Llama's (``fused_ops_apply`` False) runs the plain torch composition of the step for
every weight format; kvwise's fused layer ops compute only Llama's choices.

Pure Python (no torch): ``ModelArchConfig`` and ``kvwise size`` read families without loading
a model. Families are registered by architecture name in ``models/registry.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from kvwise.models.arch import LAYER_TYPES, ModelArchConfig, RopeScaling

NORMS = ("rms", "rms_one_plus")
ACTIVATIONS = ("silu", "gelu_tanh")

# reads ``{gguf architecture}.{key}`` of a GGUF's metadata, or the default where it is absent
GGUFGetter = Callable[[str, Any], Any]

# the linear weights of a Llama layer, by the HF names of their parts (fused in this order)
LLAMA_LINEAR_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


@dataclass(frozen=True)
class ExpertNames:
    """The HF names of a mixture-of-experts layer's tensors, within the layer (``{e}``: the
    expert's index): the router, each expert's gate / up / down projections and, where the
    model has one, the shared expert's three and the scalar gate on its output."""

    router: str
    gate: str
    up: str
    down: str
    shared: tuple[str, str, str] | None = None  # gate, up, down
    shared_scale: str | None = None
    # biases (gpt-oss): the router's, and each expert's gate / up / down projections'
    router_bias: str | None = None
    correction_bias: str | None = None  # DeepSeek-V3's e_score_correction_bias
    gate_bias: str | None = None
    up_bias: str | None = None
    down_bias: str | None = None


@dataclass(frozen=True)
class AttentionKind:
    """The attention one layer runs.

    sliding_window: a query at position p sees keys at ``p - window < pos <= p``; None: all.
    rope_theta, rope_scaling: the rotary base and scaling of this layer's q and k.
    softmax_scale: the score scale; None: ``head_dim ** -0.5``.
    softcap: each scaled score s becomes ``softcap * tanh(s / softcap)`` before the softmax
        (Gemma 2's attn_logit_softcapping); None: none.

    NOTE: the model applies the rotary of each layer's kind; the attention backend applies
    its window, scale and soft cap (``worker/attention.py``'s ``LayerAttention``).
    """

    sliding_window: int | None
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    softmax_scale: float | None = None
    softcap: float | None = None


class ModelFamily:
    """A decoder family: the class attributes say what its models compute (see the module
    docstring); the defaults are Llama's. Subclass it, set what differs, register it."""

    architectures: ClassVar[tuple[str, ...]] = ()  # HF class names (config.json)
    hf_model_types: ClassVar[dict[str, str]] = {}  # config.json model_type -> architecture
    gguf_architectures: ClassVar[dict[str, str]] = {}  # general.architecture -> architecture
    hf_activations: ClassVar[tuple[str, ...]] = ("silu",)  # config.json hidden_act values

    norm: ClassVar[str] = "rms"
    activation: ClassVar[str] = "silu"
    post_norms: ClassVar[bool] = False

    # HF tensor names (the GGUF loader renames its tensors to these)
    embed_name: ClassVar[str] = "model.embed_tokens.weight"
    final_norm_name: ClassVar[str] = "model.norm.weight"
    lm_head_name: ClassVar[str] = "lm_head.weight"
    layer_prefix: ClassVar[str] = "model.layers."
    # a layer's norm parameter -> its HF name; post_norms adds "attn_out_norm", "mlp_out_norm"
    norm_names: ClassVar[dict[str, str]] = {
        "input_norm": "input_layernorm.weight",
        "mlp_norm": "post_attention_layernorm.weight",
    }
    linear_parts: ClassVar[dict[str, tuple[str, ...]]] = LLAMA_LINEAR_PARTS
    qk_norm_names: ClassVar[tuple[str, str]] = (
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    )
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    # attention sinks' HF name within a layer (``ModelArchConfig.attention_sinks``)
    sinks_name: ClassVar[str] = "self_attn.sinks"
    # a GGUF norm's slot where llama.cpp names it otherwise for this family (gguf_weights.py's
    # defaults: ffn_norm -> mlp_norm, post_attention_norm -> attn_out_norm, ...)
    gguf_norm_slots: ClassVar[dict[str, str]] = {}
    # a mixture-of-experts family's expert tensors (models/moe.py); None: dense only
    expert_names: ClassVar[ExpertNames | None] = None
    # what llama.cpp's converter added to every norm weight (``*norm.weight``; Gemma's 1): the
    # GGUF loader subtracts it, so a GGUF's norms hold what the HF checkpoint's hold
    gguf_norm_offset: ClassVar[float] = 0.0

    @classmethod
    def check(cls) -> None:
        """Raises ValueError when the declaration is inconsistent (called at registration)."""
        if not cls.architectures:
            raise ValueError(f"family {cls.__name__}: architectures is empty")
        if cls.norm not in NORMS:
            raise ValueError(
                f"family {cls.__name__}: norm must be one of {NORMS}, got {cls.norm!r}"
            )
        if cls.activation not in ACTIVATIONS:
            raise ValueError(
                f"family {cls.__name__}: activation must be one of {ACTIVATIONS}, "
                f"got {cls.activation!r}"
            )
        slots = {"input_norm", "mlp_norm"} | (
            {"attn_out_norm", "mlp_out_norm"} if cls.post_norms else set()
        )
        if set(cls.norm_names) != slots:
            raise ValueError(f"family {cls.__name__}: norm_names must name {sorted(slots)}")
        if set(cls.linear_parts) != set(LLAMA_LINEAR_PARTS):
            raise ValueError(
                f"family {cls.__name__}: linear_parts must fuse {sorted(LLAMA_LINEAR_PARTS)}"
            )

    @classmethod
    def fused_ops_apply(cls) -> bool:
        """Whether kvwise's fused layer ops compute this family's layer: they hard-wire plain
        RMSNorm, a SiLU gate and the residual adds right after attention and the MLP."""
        return cls.norm == "rms" and cls.activation == "silu" and not cls.post_norms

    @classmethod
    def embedding_scale(cls, arch: ModelArchConfig) -> float | None:
        """The factor on embedded tokens (rounded to the model's dtype); None: none."""
        return None

    @classmethod
    def logit_softcap(cls, arch: ModelArchConfig) -> float | None:
        """The final logits' soft cap (after the quantized head's refinement); None: none.
        Default: the config's ``final_logit_softcap``."""
        return arch.final_logit_softcap

    @classmethod
    def attention_kinds(cls, arch: ModelArchConfig) -> tuple[AttentionKind, ...]:
        """One ``AttentionKind`` a layer. Default, from the config: without ``layer_types``
        every layer alike (the sliding window, if any, and the rotary); with them, a
        "sliding_attention" layer has the window and ``sliding_rope_theta`` (unscaled) where
        that is set, else the config's rotary, and a "full_attention" layer no window and the
        config's rotary (Gemma 3: rope_scaling on the global layers only). The softmax scale
        is ``query_pre_attn_scalar ** -0.5`` where that is not the head_dim; every layer's
        scores soft-capped at ``attn_logit_softcap`` where that is set."""
        scalar = arch.query_pre_attn_scalar
        scale = None if scalar is None or scalar == arch.head_dim else scalar**-0.5
        cap = arch.attn_logit_softcap
        rope, window = (arch.rope_theta, arch.rope_scaling), arch.sliding_window
        if not arch.layer_types:
            return (AttentionKind(window, *rope, scale, cap),) * arch.num_layers
        full = AttentionKind(None, *rope, scale, cap)
        sliding = AttentionKind(window, *rope, scale, cap)
        if arch.sliding_rope_theta is not None:
            sliding = AttentionKind(window, arch.sliding_rope_theta, None, scale, cap)
        return tuple(sliding if t == "sliding_attention" else full for t in arch.layer_types)

    @classmethod
    def hf_flags(cls, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        """The ``ModelArchConfig`` flags a config.json of this family sets: attention_bias,
        o_proj_bias, qk_norm, sliding_window."""
        bias = bool(config.get("attention_bias", False))
        return dict(
            attention_bias=bias,
            o_proj_bias=bias,
            qk_norm=False,
            sliding_window=config.get("sliding_window"),
        )

    @classmethod
    def hf_tensors(cls, name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """A checkpoint tensor as the HF-named tensors the loader takes (default: itself; a
        family whose checkpoint fuses what kvwise names apart splits it here)."""
        yield name, tensor

    @classmethod
    def gguf_flags(cls, get: GGUFGetter, fields: dict[str, Any]) -> dict[str, Any]:
        """The ``ModelArchConfig`` fields a GGUF's metadata of this family sets beyond those
        every GGUF has (``fields``: what ``from_gguf`` read, which these replace).

        Args:
            get: ``get(key, default)`` reads ``{general.architecture}.{key}``.
        """
        return {}


class LlamaFamily(ModelFamily):
    """Llama (SmolLM2, Llama 2/3), Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k norm)."""

    architectures = (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    )
    hf_model_types = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
    gguf_architectures = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }

    @classmethod
    def hf_flags(cls, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        bias = bool(config.get("attention_bias", False))
        return dict(
            attention_bias=True if architecture == "Qwen2ForCausalLM" else bias,
            o_proj_bias=bias and architecture not in ("MistralForCausalLM", "Qwen2ForCausalLM"),
            qk_norm=architecture == "Qwen3ForCausalLM",
            **_llama_windows(architecture, config),
        )


def _llama_windows(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of a Llama-family config.json, as transformers
    reads them. Qwen2/3: a window only with ``use_sliding_window`` (default False), and then on
    layers ``i >= max_window_layers`` (default 28) alone. Any of them: an explicit
    ``layer_types`` (Ministral-style alternating layers) names each layer's kind, as
    transformers' Qwen2/3 and Ministral classes read it (its MistralForCausalLM ignores it,
    with a warning, and windows every layer). Without a window every layer is full; a window
    on every layer needs no ``layer_types``."""
    qwen = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    window = config.get("sliding_window")
    if qwen and not config.get("use_sliding_window", False):
        window = None
    types = config.get("layer_types")
    if types is None and qwen and window is not None:
        first = int(config.get("max_window_layers", 28))
        types = [
            "sliding_attention" if i >= first else "full_attention"
            for i in range(int(config["num_hidden_layers"]))
        ]
    if types is None:
        return dict(sliding_window=window, layer_types=())
    if set(types) <= set(LAYER_TYPES):  # else ModelArchConfig refuses them by name
        if window is None or "sliding_attention" not in types:
            return dict(sliding_window=None, layer_types=())  # transformers: no layer slides
        if all(t == "sliding_attention" for t in types):
            types = ()  # every layer alike
    return dict(sliding_window=window, layer_types=tuple(types))

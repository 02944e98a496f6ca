"""What a model costs a token, for the roofline (``roofline.py``): a transformer's shape
(``ModelShape``: its matmuls' parameters and FLOPs, its attention's FLOPs, its KV bytes a
token; a mixture of experts counted as the experts a token runs, latent attention as its
projections), the presets ``kvwise breakeven --model`` names, and a shape read from a GGUF,
an HF directory or a ``layers=...,hidden=...`` text. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvwise.core.kv_spec import KVSpec, default_block_size

WEIGHT_DTYPE_BYTES = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a transformer (Llama-shaped: q/k/v/o, a gated MLP)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    source: str = ""
    # one layer's attention projections where they are not Llama's q/k/v/o (latent attention)
    attention_params: int = 0

    def __post_init__(self) -> None:
        for f in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{f}: expected a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide {self.num_heads}")

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer's matmuls (q, k, v, o, gate, up, down)."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attention = self.attention_params or 2 * h * q + 2 * h * kv
        return attention + 3 * h * self.intermediate_size

    @property
    def linear_params(self) -> int:
        """Parameters every token multiplies by (the decoder layers; not the embedding)."""
        return self.num_layers * self.layer_params

    @property
    def head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def total_params(self) -> int:
        embeddings = self.head_params * (1 if self.tie_word_embeddings else 2)
        return self.linear_params + embeddings

    def kv_bytes_per_token(self, kv_dtype: str) -> float:
        """K and V of one token in every layer as the format stores them, scales included
        (``KVSpec``; at the format's default block size)."""
        spec = KVSpec(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            default_block_size(kv_dtype),
            kv_dtype,
        )
        return spec.bytes_per_token

    def linear_flops(self, q: int) -> float:
        """FLOPs of one forward's matmuls over ``q`` tokens and one token's LM head."""
        return 2.0 * self.linear_params * q + 2.0 * self.head_params

    def attention_flops(self, q: int, c: int) -> float:
        """Scores and weighted sum of ``q`` new tokens over ``c`` cached ones (causal)."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * q * (c + (q + 1) / 2)

    @classmethod
    def from_arch(cls, arch, name: str, source: str = "") -> ModelShape:
        """The shape of ``arch``; a mixture-of-experts model's MLP counted as the experts one
        token runs (``mlp_width``), what a decode step reads."""
        return cls(
            name,
            arch.num_layers,
            arch.hidden_size,
            mlp_width(arch),
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            arch.vocab_size,
            arch.tie_word_embeddings,
            source,
            latent_attention_params(arch),
        )


def latent_attention_params(arch) -> int:
    """One layer's latent-attention projections (``models/mla.py``): the queries (full or
    through their low rank), the latent and rotary key (kv_a), their expansion (kv_b) and the
    output; 0 for any other attention (the roofline's Llama-shaped count applies)."""
    if not arch.kv_lora_rank:
        return 0
    h, heads, rank = arch.hidden_size, arch.num_heads, arch.kv_lora_rank
    qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
    q = h * heads * qk if not arch.q_lora_rank else arch.q_lora_rank * (h + heads * qk)
    kv = h * (rank + arch.qk_rope_head_dim) + rank * heads * (
        arch.qk_nope_head_dim + arch.v_head_dim
    )
    return q + kv + heads * arch.v_head_dim * h


def mlp_width(arch) -> int:
    """The MLP's hidden width one token multiplies by: the dense ``intermediate_size``, or for
    a mixture of experts its ``num_experts_per_tok`` experts plus the shared one, averaged over
    the layers (a dense layer counts its own). A prefill of many tokens reads more experts
    than this (up to all of them); the roofline counts a decode's."""
    if not getattr(arch, "num_experts", 0):
        return arch.intermediate_size
    active = arch.num_experts_per_tok * arch.moe_intermediate_size
    active += arch.shared_expert_intermediate_size
    widths = [
        active if arch.is_moe_layer(i) else arch.intermediate_size for i in range(arch.num_layers)
    ]
    return round(sum(widths) / arch.num_layers)


MODELS = {
    "smollm2-135m": ModelShape(
        "SmolLM2-135M",
        30,
        576,
        1536,
        9,
        3,
        64,
        49152,
        True,
        "HuggingFaceTB/SmolLM2-135M config.json (kvwise's default model)",
    ),
    "llama-3-8b": ModelShape(
        "Llama-3-8B",
        32,
        4096,
        14336,
        32,
        8,
        128,
        128256,
        False,
        "meta-llama/Meta-Llama-3-8B config.json",
    ),
    "llama-3-70b": ModelShape(
        "Llama-3-70B",
        80,
        8192,
        28672,
        64,
        8,
        128,
        128256,
        False,
        "meta-llama/Meta-Llama-3-70B config.json",
    ),
}
MODEL_ALIASES = {"default": "smollm2-135m"}


def model_shape(name_or_path: str | None) -> ModelShape:
    """A preset by name (``default``, ``llama-3-70b``, ...) or a GGUF / HF directory / config."""
    key = (name_or_path or "default").lower()
    key = MODEL_ALIASES.get(key, key)
    if key in MODELS:
        return MODELS[key]
    if "=" in key:
        return _shape_from_text(key)
    if not Path(name_or_path).exists():
        raise ValueError(
            f"model: unknown preset or missing path {name_or_path!r}; presets: "
            f"{', '.join(['default', *MODELS])}"
        )
    from kvwise.perf.sizing import arch_from_model

    arch, name = arch_from_model(name_or_path)
    return ModelShape.from_arch(arch, name, source=str(name_or_path))


_SHAPE_KEYS = {
    "layers": "num_layers",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab": "vocab_size",
}


def _shape_from_text(text: str) -> ModelShape:
    """``layers=80,hidden=8192,intermediate=28672,heads=64,kv_heads=8,vocab=128256[,head_dim=128]
    [,tied=1]``: a Llama-shaped model given by its dimensions."""
    fields: dict = {}
    tied = False
    for part in text.split(","):
        k, _, v = part.strip().partition("=")
        if k == "tied":
            tied = v not in ("0", "false", "no")
            continue
        if k not in _SHAPE_KEYS:
            raise ValueError(
                f"model: unknown dimension {k!r} in {text!r}; expected "
                f"{', '.join([*_SHAPE_KEYS, 'tied'])}"
            )
        try:
            fields[_SHAPE_KEYS[k]] = int(v)
        except ValueError:
            raise ValueError(f"model: {k} must be an integer, got {v!r}") from None
    if "head_dim" not in fields and "hidden_size" in fields and "num_heads" in fields:
        fields["head_dim"] = fields["hidden_size"] // fields["num_heads"]
    missing = [k for k, f in _SHAPE_KEYS.items() if f not in fields]
    if missing:
        raise ValueError(f"model: the shape lacks {', '.join(missing)}")
    return ModelShape("custom shape", **fields, tie_word_embeddings=tied, source=text)

"""``ModelArchConfig`` from a Hugging Face ``config.json`` dict (``arch_from_hf_config``) or a
GGUF file's metadata (``arch_from_gguf``), through the registered families: an architecture no
family registered is refused by name, and each family reads its own flags
(``ModelFamily.hf_flags``, ``ModelFamily.gguf_flags``)."""

from __future__ import annotations

from typing import Any

from kvwise.models import registry
from kvwise.models.arch import ModelArchConfig, RopeScaling


def arch_from_hf_config(config: dict[str, Any]) -> ModelArchConfig:
    """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

    Raises:
        ValueError: unsupported architecture, rope type, activation or missing field.
    """
    architecture = _hf_architecture(config)
    family = registry.family_for(architecture)
    # Gemma's modeling reads hidden_activation (its configs may hold a stale hidden_act)
    act_key = "hidden_activation" if "hidden_activation" in config else "hidden_act"
    if config.get(act_key, family.hf_activations[0]) not in family.hf_activations:
        raise ValueError(
            f"{act_key}: only {', '.join(map(repr, family.hf_activations))} is supported, "
            f"got {config[act_key]!r}"
        )
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported")
    try:
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        max_pos = int(config.get("max_position_embeddings", 2048))
        # transformers 5 writes rope_parameters (with rope_theta inside); 4.x rope_scaling.
        rope_params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_theta = config.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        if float(rope_params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor: partial rotary is not supported")
        eos = config.get("eos_token_id")
        fields = dict(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_hf(rope_params, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
        )
        fields.update(family.hf_flags(architecture, config))  # may replace the rotary
    except KeyError as exc:
        raise ValueError(f"model: config.json lacks required field {exc.args[0]!r}") from None
    return ModelArchConfig(**fields)


# GGUF architectures llama.cpp also writes mixture-of-experts models as (with expert metadata)
_EXPERT_TWINS = {"llama": "MixtralForCausalLM"}


def arch_from_gguf(reader: Any) -> ModelArchConfig:
    """Build from a `gguf.GGUFReader`'s metadata (architectures llama — Mixtral's too, with
    expert metadata —, qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3; the family reads its
    own keys: ``ModelFamily.gguf_flags``).

    Tied embeddings are inferred from the absence of an ``output.weight`` tensor, and
    Llama 3.1 scaling from a ``rope_freqs.weight`` tensor (as llama.cpp does).
    """
    gguf_arch = str(_gguf_field(reader, "general.architecture"))
    architecture = registry.architecture_for_gguf(gguf_arch)
    if architecture is None:
        raise registry.unsupported(gguf_arch)

    def get(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{gguf_arch}.{key}", default)

    if gguf_arch in _EXPERT_TWINS and get("expert_count"):
        architecture = _EXPERT_TWINS[gguf_arch]  # llama.cpp writes Mixtral as "llama"

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    vocab = get("vocab_size")
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    eos = [_gguf_field(reader, "tokenizer.ggml.eos_token_id")]
    eos.append(_gguf_field(reader, "tokenizer.ggml.eot_token_id"))
    fields = dict(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", 0) or hidden // num_heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(get, tensors),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=None,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_as_id_tuple([e for e in eos if e is not None]),
    )
    fields.update(registry.family_for(architecture).gguf_flags(get, fields))
    return ModelArchConfig(**fields)


def _gguf_rope_scaling(get: Any, tensors: dict[str, Any]) -> RopeScaling | None:
    scaling = None
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor")))
    elif scaling_type == "yarn":  # the default attention factor, as transformers computes it
        scaling = RopeScaling.from_hf(
            dict(
                rope_type="yarn",
                factor=float(get("rope.scaling.factor")),
                original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
                beta_fast=get("rope.scaling.yarn_beta_fast"),
                beta_slow=get("rope.scaling.yarn_beta_slow"),
            ),
            int(get("context_length", 2048)),
        )
    elif scaling_type not in ("none", None):
        raise ValueError(f"rope_scaling: unsupported GGUF rope scaling type '{scaling_type}'")
    if "rope_freqs.weight" in tensors:
        factors = tuple(float(x) for x in tensors["rope_freqs.weight"].data.reshape(-1))
        scaling = RopeScaling("freq_factors", freq_factors=factors)
    return scaling


def _hf_architecture(config: dict[str, Any]) -> str:
    """The architecture a config.json names: its first ``architectures`` entry when that is
    registered (as vLLM picks a model class; a toy or plug-in family registers its own name
    over a config of a known ``model_type``), else the one its ``model_type`` maps to."""
    archs = config.get("architectures") or []
    if archs and registry.is_supported(archs[0]):
        return archs[0]
    by_type = registry.architecture_for_model_type(config.get("model_type"))
    if by_type is not None:
        return by_type
    return archs[0] if archs else str(config.get("model_type"))


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value.item() if hasattr(value, "item") else value

"""The mixture-of-experts families: Qwen2-MoE and Qwen3-MoE (``QwenMoeFamily``), Mixtral
(``MixtralFamily``) and gpt-oss (``GptOssFamily``). Their attention is Llama's (Qwen2's q/k/v
biases, Qwen3's q/k norm; gpt-oss's biases, attention sinks and sliding windows on alternate
layers, with YaRN rotary); their MLP is ``models/moe.py``'s on every layer but the dense ones
the config names. What each declares: its expert tensors' names (``ExpertNames``) and how its
config.json sets the routing (``ModelArchConfig.num_experts`` and the fields after it)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvwise.models.family import ExpertNames, ModelFamily, _llama_windows

if TYPE_CHECKING:  # no torch at import (the registry is read without it)
    import torch

QWEN_EXPERTS = ExpertNames(
    router="mlp.gate.weight",
    gate="mlp.experts.{e}.gate_proj.weight",
    up="mlp.experts.{e}.up_proj.weight",
    down="mlp.experts.{e}.down_proj.weight",
    shared=(
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
        "mlp.shared_expert.down_proj.weight",
    ),
    shared_scale="mlp.shared_expert_gate.weight",
)
MIXTRAL_EXPERTS = ExpertNames(
    router="block_sparse_moe.gate.weight",
    gate="block_sparse_moe.experts.{e}.w1.weight",
    up="block_sparse_moe.experts.{e}.w3.weight",
    down="block_sparse_moe.experts.{e}.w2.weight",
)


GPT_OSS_EXPERTS = ExpertNames(  # one tensor an expert (the checkpoint's fused ones split)
    router="mlp.router.weight",
    gate="mlp.experts.{e}.gate_proj.weight",
    up="mlp.experts.{e}.up_proj.weight",
    down="mlp.experts.{e}.down_proj.weight",
    router_bias="mlp.router.bias",
    gate_bias="mlp.experts.{e}.gate_proj.bias",
    up_bias="mlp.experts.{e}.up_proj.bias",
    down_bias="mlp.experts.{e}.down_proj.bias",
)


class QwenMoeFamily(ModelFamily):
    """Qwen2-MoE (q/k/v biases, a shared expert behind a sigmoid gate) and Qwen3-MoE (q/k
    norm, no shared expert). A layer is dense where ``mlp_only_layers`` names it or off
    ``decoder_sparse_step``."""

    architectures = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    hf_model_types = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    gguf_architectures = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
    expert_names = QWEN_EXPERTS

    @classmethod
    def gguf_flags(cls, get, fields: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's metadata: the expert counts and widths; Qwen3-MoE renormalises its
        top-k (llama.cpp's qwen3moe graph always does), Qwen2-MoE gates its shared expert."""
        shared = int(get("expert_shared_feed_forward_length", 0) or 0)
        return dict(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            norm_topk_prob=fields["architecture"] == "Qwen3MoeForCausalLM",
            shared_expert_intermediate_size=shared,
            shared_expert_gate=bool(shared),
        )

    @classmethod
    def hf_flags(cls, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        qwen2 = architecture == "Qwen2MoeForCausalLM"
        bias = bool(config.get("qkv_bias", True) if qwen2 else config.get("attention_bias", False))
        num_layers, step = (
            int(config["num_hidden_layers"]),
            int(config.get("decoder_sparse_step", 1)),
        )
        dense = set(config.get("mlp_only_layers") or ())
        dense |= {i for i in range(num_layers) if (i + 1) % step}
        shared = int(config.get("shared_expert_intermediate_size") or 0) if qwen2 else 0
        dense_twin = "Qwen2ForCausalLM" if qwen2 else "Qwen3ForCausalLM"  # its windows
        return dict(
            attention_bias=bias,
            o_proj_bias=bias and not qwen2,
            qk_norm=not qwen2,
            **_llama_windows(dense_twin, config),
            **_experts(config, "num_experts", bool(config.get("norm_topk_prob", False))),
            shared_expert_intermediate_size=shared,
            shared_expert_gate=bool(shared),
            dense_layers=tuple(sorted(dense)),
        )


class MixtralFamily(ModelFamily):
    """Mixtral: Mistral's attention, eight experts a layer, two a token, renormalised."""

    architectures = ("MixtralForCausalLM",)
    hf_model_types = {"mixtral": "MixtralForCausalLM"}
    expert_names = MIXTRAL_EXPERTS  # a GGUF: "llama" with expert metadata (arch_load.py)

    @classmethod
    def gguf_flags(cls, get, fields: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's metadata: the expert counts; each expert as wide as the dense MLP
        would be (``feed_forward_length``), its top 2 renormalised."""
        width = get("expert_feed_forward_length") or fields["intermediate_size"]
        return dict(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(width),
            norm_topk_prob=True,
        )

    @classmethod
    def hf_flags(cls, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        return dict(
            attention_bias=False,
            o_proj_bias=False,
            qk_norm=False,
            **_llama_windows("MistralForCausalLM", config),
            **_experts(config, "num_local_experts", True),
        )


class GptOssFamily(ModelFamily):
    """gpt-oss: Llama's attention with q/k/v/o biases and a learned sink logit per head,
    sliding windows (128) on alternate layers (``layer_types``), YaRN rotary; every layer a
    mixture of experts routed "topk_softmax" with a router bias, each expert's projections
    biased and gated by the clamped SwiGLU (``swiglu_clamped``)."""

    architectures = ("GptOssForCausalLM",)
    hf_model_types = {"gpt_oss": "GptOssForCausalLM"}
    gguf_architectures = {"gpt-oss": "GptOssForCausalLM"}
    expert_names = GPT_OSS_EXPERTS
    gguf_norm_slots = {"post_attention_norm.weight": "mlp_norm"}  # llama.cpp's name for it

    @classmethod
    def gguf_flags(cls, get, fields: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's metadata: the expert counts and width, the window on every other layer
        from the first (its swa pattern of 2), YaRN without truncation (gpt-oss's config);
        the clamped SwiGLU's alpha is llama.cpp's constant, its limit the file's
        ``swiglu_clamp_exp`` where written (one value a layer, all alike), else 7 as there."""
        layers, scaling = fields["num_layers"], fields["rope_scaling"]
        if scaling is not None and scaling.rope_type == "yarn":
            scaling = dataclasses.replace(scaling, truncate=False)
        return dict(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            sliding_window=int(get("attention.sliding_window")),
            layer_types=tuple(
                "full_attention" if i % 2 else "sliding_attention" for i in range(layers)
            ),
            rope_scaling=scaling,
            swiglu_limit=_one_value(get("swiglu_clamp_exp", 7.0), "swiglu_clamp_exp"),
            **GPT_OSS_MOE,
        )

    @classmethod
    def hf_flags(cls, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        bias = bool(config.get("attention_bias", True))
        return dict(
            attention_bias=bias,
            o_proj_bias=bias,
            qk_norm=False,
            **_llama_windows(architecture, config),
            **_experts(config, "num_local_experts", False),
            **GPT_OSS_MOE,
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        )

    @classmethod
    def hf_tensors(cls, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's fused expert tensors as one HF-layout tensor an expert: gate_up
        ``(E, hidden, 2 inter)`` (gate and up interleaved, ``[in, out]``) into each expert's
        gate and up ``(inter, hidden)``, down ``(E, inter, hidden)`` into ``(hidden, inter)``,
        their biases alike.

        Raises:
            ValueError: MXFP4 expert blocks (``*_blocks`` / ``*_scales``, the released
                checkpoints' form), which this loader does not read.
        """
        prefix, _, within = name.rpartition("mlp.experts.")
        if within.endswith(("_blocks", "_scales")):
            raise ValueError(
                f"weights: '{name}' holds MXFP4 expert blocks, which kvwise reads from GGUF "
                "files only (llama.cpp's converter); give the GGUF or a float checkpoint"
            )
        if within not in _GPT_OSS_FUSED:
            yield name, tensor
            return
        names, is_bias = _GPT_OSS_FUSED[within]
        for e in range(tensor.shape[0]):
            if len(names) == 1:  # down, (inter, hidden) [in, out]
                part = tensor[e] if is_bias else tensor[e].t()
                yield f"{prefix}mlp.experts.{e}.{names[0]}", part
                continue
            for i, part_name in enumerate(names):  # gate at even columns, up at odd
                part = tensor[e][i::2] if is_bias else tensor[e][:, i::2].t()
                yield f"{prefix}mlp.experts.{e}.{part_name}", part


DEEPSEEK_EXPERTS = ExpertNames(
    router="mlp.gate.weight",
    gate="mlp.experts.{e}.gate_proj.weight",
    up="mlp.experts.{e}.up_proj.weight",
    down="mlp.experts.{e}.down_proj.weight",
    shared=(
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
    ),
    correction_bias="mlp.gate.e_score_correction_bias",
)


class DeepseekFamily(ModelFamily):
    """DeepSeek-V2 (V2-Lite) and V3: multi-head latent attention (``models/mla.py``; its cache
    one latent row a token), YaRN with an mscale on the softmax scale too, dense layers first
    (``first_k_dense_replace``), then experts with shared ones: V2 softmax routing (greedy or
    group-limited), V3 sigmoid routing with a correction bias, group-limited, renormalised;
    both scaled by ``routed_scaling_factor``."""

    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    hf_model_types = {
        "deepseek_v2": "DeepseekV2ForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
    }
    expert_names = DEEPSEEK_EXPERTS

    @classmethod
    def hf_flags(cls, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        rank, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
        v3 = architecture == "DeepseekV3ForCausalLM"
        grouped = v3 or config.get("topk_method") == "group_limited_greedy"
        moe_inter = int(config["moe_intermediate_size"])
        return dict(
            attention_bias=False,
            o_proj_bias=False,
            qk_norm=False,
            sliding_window=None,
            num_kv_heads=1,
            head_dim=rank + rope,
            kv_lora_rank=rank,
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=rope,
            v_head_dim=int(config["v_head_dim"]),
            **_experts(config, "n_routed_experts", bool(config.get("norm_topk_prob", False))),
            shared_expert_intermediate_size=moe_inter * int(config.get("n_shared_experts") or 0),
            dense_layers=tuple(range(int(config.get("first_k_dense_replace") or 0))),
            routing="sigmoid_topk" if v3 else "softmax_topk",
            router_correction_bias=v3,
            n_group=int(config.get("n_group") or 1) if grouped else 1,
            topk_group=int(config.get("topk_group") or 1) if grouped else 1,
            routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        )

    @classmethod
    def attention_kinds(cls, arch) -> tuple:
        """The default's, at the expanded head's scale ``(nope + rope) ** -0.5``, times YaRN's
        mscale squared where its scaling has one for every dimension (transformers'
        ``yarn_apply_mscale``)."""
        scale = (arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5
        scaling = arch.rope_scaling
        if scaling is not None and scaling.rope_type == "yarn" and scaling.mscale_all_dim:
            mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
            scale = scale * mscale * mscale if scaling.factor > 1 else scale
        return tuple(
            dataclasses.replace(kind, softmax_scale=scale) for kind in super().attention_kinds(arch)
        )


# gpt-oss's routing and experts (ModelArchConfig's fields), HF and GGUF alike
GPT_OSS_MOE = dict(
    routing="topk_softmax",
    router_bias=True,
    expert_bias=True,
    expert_glu="swiglu_clamped",
    attention_sinks=True,
)
# its fused checkpoint tensors within "mlp.experts." -> the per-expert names, and whether a bias
_GPT_OSS_FUSED = {
    "gate_up_proj": (("gate_proj.weight", "up_proj.weight"), False),
    "gate_up_proj_bias": (("gate_proj.bias", "up_proj.bias"), True),
    "down_proj": (("down_proj.weight",), False),
    "down_proj_bias": (("down_proj.bias",), True),
}


def _experts(config: dict[str, Any], count_key: str, norm_topk_prob: bool) -> dict[str, Any]:
    """The routing fields of a MoE config.json (``ModelArchConfig``); the expert count under
    the family's key, or the other one (transformers 5 writes Qwen3-MoE's as
    ``num_local_experts``, released checkpoints as ``num_experts``)."""
    other = "num_experts" if count_key == "num_local_experts" else "num_local_experts"
    count = config.get(count_key) or config.get(other)
    if count is None:
        raise KeyError(count_key)
    return dict(
        num_experts=int(count),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(
            config.get("moe_intermediate_size") or config["intermediate_size"]
        ),
        norm_topk_prob=norm_topk_prob,
    )


def _one_value(value: Any, key: str) -> float:
    """A GGUF key's value that may be written once a layer: the one value all layers share.

    Raises:
        ValueError: layers with different values (naming the key).
    """
    values = set(value) if isinstance(value, list | tuple) else {value}
    if len(values) != 1:
        raise ValueError(f"{key}: one value for every layer is supported, got {sorted(values)}")
    return float(values.pop())

"""The mixture-of-experts families: Qwen2-MoE and Qwen3-MoE (``QwenMoeFamily``) and Mixtral
(``MixtralFamily``). Their attention is Llama's (Qwen2's q/k/v biases, Qwen3's q/k norm);
their MLP is ``models/moe.py``'s on every layer but the dense ones the config names. What
each declares: its expert tensors' names (``ExpertNames``) and how its config.json sets the
routing (``ModelArchConfig.num_experts`` and the fields after it)."""

from __future__ import annotations

from typing import Any

from kvwise.models.family import ExpertNames, ModelFamily, _llama_windows

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

"""Mixture-of-experts fields of ModelArchConfig, read from config.json, and what the roofline
counts of them (pure Python: no weights)."""

import pytest

from kvwise.models.arch_load import arch_from_hf_config
from kvwise.perf.model_shape import ModelShape, mlp_width

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def test_a_qwen3_moe_config_reads_its_routing():
    arch = arch_from_hf_config(QWEN3_30B_A3B)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (128, 8, 768)
    assert arch.norm_topk_prob and arch.qk_norm and not arch.dense_layers
    assert all(arch.is_moe_layer(i) for i in range(48))
    # transformers 5 writes the count as num_local_experts
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert arch_from_hf_config({**renamed, "num_local_experts": 128}).num_experts == 128


def test_qwen2_moe_dense_layers_and_shared_expert():
    config = {
        **QWEN3_30B_A3B,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 4,
        "mlp_only_layers": [0],
        "decoder_sparse_step": 2,
    }
    arch = arch_from_hf_config(config)
    assert arch.dense_layers == (0, 2)  # named, and off the sparse step
    assert arch.shared_expert_gate and arch.attention_bias and not arch.qk_norm
    assert mlp_width(arch) == round((6144 * 2 + (8 * 768 + 5632) * 2) / 4)


def test_the_roofline_counts_the_active_experts():
    arch = arch_from_hf_config(QWEN3_30B_A3B)
    shape = ModelShape.from_arch(arch, "qwen3-30b-a3b")
    assert shape.intermediate_size == 8 * 768
    # ~3.3 B parameters active a token (the model card: 3.3 B activated)
    assert 3.0e9 < shape.total_params < 3.6e9


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 129}, "num_experts_per_tok"),
    ],
)
def test_bad_routing_is_refused_by_name(bad, field):
    with pytest.raises(ValueError, match=field):
        arch_from_hf_config({**QWEN3_30B_A3B, **bad})

"""What ``kvwise size`` and the roofline say of a latent-attention model (DeepSeek-V2-Lite's
shape, from its config.json alone): the cache's bytes a token are the latent row's (as the
pool stores it: K and V of one 576-wide head), 4.44x fewer than the heads' K/V expanded in
bfloat16; the roofline counts the latent projections, not Llama-shaped q/k/v/o."""

from __future__ import annotations

from kvwise.models.arch_load import arch_from_hf_config
from kvwise.perf.model_shape import ModelShape, latent_attention_params
from kvwise.perf.sizing import latent_summary

V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
    num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
    max_position_embeddings=163840, topk_method="greedy",
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32,
                         beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
                         original_max_position_embeddings=4096),
)  # fmt: skip


def test_the_cache_holds_the_latent():
    arch = arch_from_hf_config(V2_LITE)
    assert (arch.num_kv_heads, arch.head_dim, arch.rope_dim) == (1, 576, 64)
    text = latent_summary(arch, "bfloat16", 8192, 8 << 30)
    assert "62,208 B a token" in text  # 27 layers x 2 x 576 x 2 B
    assert "276,480 B, 4.44x" in text  # 27 x 16 heads x (192 + 128) x 2 B
    assert "16 latent, 3 expanded" in text
    dense = arch_from_hf_config({**V2_LITE, "architectures": ["LlamaForCausalLM"],
                                 "model_type": "llama", "num_key_value_heads": 16})  # fmt: skip
    assert latent_summary(dense, "bfloat16", 8192, None) is None


def test_the_roofline_counts_the_latent_projections():
    arch = arch_from_hf_config(V2_LITE)
    # q 2048 x 16 x 192, kv_a 2048 x 576, kv_b 512 x 16 x 256, o 16 x 128 x 2048
    assert latent_attention_params(arch) == 6_291_456 + 1_179_648 + 2_097_152 + 4_194_304
    shape = ModelShape.from_arch(arch, "v2-lite")
    assert shape.attention_params == latent_attention_params(arch)
    assert 2.5e9 < shape.total_params < 2.8e9  # DeepSeek's "2.4 B activated" + embeddings

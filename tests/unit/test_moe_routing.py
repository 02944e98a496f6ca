"""The routers of ``models/moe.py`` against transformers' own modules, on the same weights:
DeepSeek-V2's softmax with group-limited greedy top-k and a routed scaling factor, DeepSeek-V3's
sigmoid scores with a correction bias, group-limited top-k over the best two of each group,
renormalised and scaled, gpt-oss's top-k then softmax with a router bias, and Qwen's softmax
top-k renormalised. Each token's chosen experts and their weights (as sets: the order of a
token's choices does not matter, its sum runs in expert order)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvwise.models.arch import ModelArchConfig  # noqa: E402
from kvwise.models.moe import MoEWeights  # noqa: E402

HIDDEN, EXPERTS = 32, 16


def _arch(**routing) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=HIDDEN,
        intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        num_experts=EXPERTS, moe_intermediate_size=16, **routing,
    )  # fmt: skip


def _ours(arch: ModelArchConfig, weight, bias=None, correction=None) -> MoEWeights:
    moe = MoEWeights(arch, torch.float32)
    with torch.no_grad():
        moe.router.copy_(weight.t())
        if bias is not None:
            moe.router_bias.copy_(bias)
        if correction is not None:
            moe.correction_bias.copy_(correction)
    return moe


def _same_choices(ids, weights, want_ids, want_weights) -> None:
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    got = weights.gather(1, order.indices)
    want = want_weights.gather(1, want_order.indices)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router(topk_method):
    config = transformers.DeepseekV2Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=3, n_group=4,
        topk_group=2, topk_method=topk_method, routed_scaling_factor=2.5,
    )  # fmt: skip
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    theirs = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(theirs.weight, std=0.5)
    groups = (4, 2) if topk_method == "group_limited_greedy" else (1, 1)
    arch = _arch(num_experts_per_tok=3, n_group=groups[0], topk_group=groups[1],
                 routed_scaling_factor=2.5)  # fmt: skip
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    _, want_weights, want_ids = theirs(x)
    ids, weights = _ours(arch, theirs.weight.detach()).route(x)
    _same_choices(ids, weights, want_ids, want_weights)


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_router(norm):
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=4, n_group=4,
        topk_group=2, norm_topk_prob=norm, routed_scaling_factor=2.5,
    )  # fmt: skip
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    theirs = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(theirs.weight, std=0.5)
    theirs.e_score_correction_bias.normal_(std=0.3)
    arch = _arch(num_experts_per_tok=4, routing="sigmoid_topk", n_group=4, topk_group=2,
                 norm_topk_prob=norm, routed_scaling_factor=2.5, router_correction_bias=True)  # fmt: skip
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2))
    _, want_weights, want_ids = theirs(x)
    moe = _ours(arch, theirs.weight.detach(), correction=theirs.e_score_correction_bias)
    ids, weights = moe.route(x)
    _same_choices(ids, weights, want_ids, want_weights)
    # the correction bias only chooses: without it, other experts for some tokens
    moe.correction_bias.zero_()
    assert not torch.equal(moe.route(x)[0].sort(-1).values, want_ids.sort(-1).values)


def test_gpt_oss_router():
    config = transformers.GptOssConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS,
                                       num_experts_per_tok=4)  # fmt: skip
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    theirs = GptOssTopKRouter(config)
    torch.nn.init.normal_(theirs.weight, std=0.5)
    torch.nn.init.normal_(theirs.bias, std=0.5)
    arch = _arch(num_experts_per_tok=4, routing="topk_softmax", router_bias=True)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(3))
    _, want_weights, want_ids = theirs(x)
    ids, weights = _ours(arch, theirs.weight.detach(), bias=theirs.bias.detach()).route(x)
    _same_choices(ids, weights, want_ids, want_weights)


def test_group_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="n_group"):
        _arch(num_experts_per_tok=2, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        _arch(num_experts_per_tok=2, n_group=4, topk_group=5)

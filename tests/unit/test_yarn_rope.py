"""YaRN rotary scaling (gpt-oss, DeepSeek): kvwise's frequencies and cos/sin scale are
transformers' (``_compute_yarn_parameters``), for gpt-oss's settings (no truncation), the
default ones (truncated correction range) and DeepSeek's ``mscale`` / ``mscale_all_dim`` pair;
a config without ``original_max_position_embeddings`` refused by name."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvwise.models.arch import RopeScaling  # noqa: E402
from kvwise.models.layers import rope_inv_freq, rope_table  # noqa: E402

CASES = {
    "gpt-oss": dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096, rope_theta=150000.0),
    "default": dict(factor=4.0, original_max_position_embeddings=2048, rope_theta=10000.0),
    "deepseek": dict(factor=40.0, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
                     original_max_position_embeddings=4096, rope_theta=10000.0),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_yarn_is_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="yarn", **CASES[case])
    config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_parameters=params,
    )  # fmt: skip
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    scaling = RopeScaling.from_hf(params, 131072)
    assert scaling.attention_factor == pytest.approx(factor, rel=1e-12)
    got = rope_inv_freq(64, params["rope_theta"], scaling)
    assert torch.equal(got, want.float())
    table = rope_table(100, 64, params["rope_theta"], scaling)  # cos and signed sin, scaled
    freqs = torch.arange(100).float()[:, None] * want.float()[None, :]
    assert torch.allclose(table[:, 0, :32], freqs.cos() * factor, atol=1e-6)
    assert torch.allclose(table[:, 1, 32:], freqs.sin() * factor, atol=1e-6)


def test_yarn_without_its_original_length_is_refused():
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeScaling("yarn", factor=4.0)

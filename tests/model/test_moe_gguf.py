"""Mixture-of-experts GGUF files written the way llama.cpp's converter writes them (qwen2moe,
qwen3moe: the experts stacked in ``ffn_{gate,up,down}_exps``, the router ``ffn_gate_inp``,
the shared expert ``*_shexp``), read as float experts and checked against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from kvwise.models.layers import dense_causal_attention  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from tests.model.test_gguf_tiny import (  # noqa: E402
    COMMON,
    _gguf_name,
    _random_hf,
    add_common_metadata,
    finish,
)

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {
    "qwen3moe": ("Qwen3MoeConfig", dict(head_dim=16, norm_topk_prob=True, **MOE)),
    "qwen2moe": ("Qwen2MoeConfig", dict(shared_expert_intermediate_size=48, **MOE)),
}
_MOE_NAMES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def _write_moe_gguf(hf, arch: str, path) -> None:
    config = hf.config
    writer = gguf.GGUFWriter(path, arch=arch)
    add_common_metadata(writer, config, arch)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    inter = config.moe_intermediate_size
    for name, tensor in hf.state_dict().items():
        w = tensor.detach().numpy().astype(np.float32)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        within = name.split(".", 3)[3] if layer is not None else None
        if within == "mlp.experts.gate_up_proj":  # (E, 2 * inter, hidden): gate rows first
            writer.add_tensor(
                f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(w[:, :inter])
            )
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(w[:, inter:]))
        elif within == "mlp.experts.down_proj":  # (E, hidden, inter)
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", w)
        elif within in _MOE_NAMES:
            if within == "mlp.shared_expert_gate.weight":
                w = w.reshape(-1)  # llama.cpp stores the shared gate as a vector
            writer.add_tensor(f"blk.{layer}.{_MOE_NAMES[within]}", w)
        else:
            writer.add_tensor(_gguf_name(name), w)
    finish(writer)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_a_moe_gguf_matches_transformers(arch, tmp_path):
    config_name, overrides = CASES[arch]
    hf = _random_hf(config_name, **overrides)
    path = tmp_path / f"{arch}.gguf"
    _write_moe_gguf(hf, arch, path)
    loaded = load_model(path, progress=False)
    assert loaded.arch.num_experts == 4 and loaded.arch.num_experts_per_tok == 2
    assert loaded.arch.norm_topk_prob == (arch == "qwen3moe")
    assert bool(loaded.arch.shared_expert_intermediate_size) == (arch == "qwen2moe")
    torch.manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (20,))
    with torch.inference_mode():
        hidden = loaded.model(
            ids, torch.arange(20), lambda i, q, k, v: dense_causal_attention(q, k, v)
        )
        logits = loaded.model.compute_logits(hidden)
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="^quantization: a mixture-of-experts GGUF"):
        load_model(path, progress=False, quantization="auto")
    int8 = load_model(path, progress=False, quantization="int8")
    assert all(layer.moe.quant is not None for layer in int8.model.layers)

"""Tiny GGUF files written the way llama.cpp's converter writes them, checked against transformers.

Covers what the SmolLM2 file cannot: llama q/k permutation with GQA, qwen2 (bias, tied) and
qwen3 (q/k norm, key_length) metadata, untied `output.weight`, and `rope_freqs` (Llama 3.1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from kvwise.models.layers import dense_causal_attention  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
_PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (n_head already the kv count for k)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_PER_LAYER[rest]}"


def add_common_metadata(writer, config, arch: str) -> None:
    """The metadata llama.cpp's converter writes for every decoder (shapes, rope, tokens)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if arch in ("qwen3", "qwen3moe"):  # the archs whose converter writes key_length
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_gguf(hf_model, arch: str, path, rope_freqs: np.ndarray | None = None) -> None:
    config = hf_model.config
    writer = gguf.GGUFWriter(path, arch=arch)
    add_common_metadata(writer, config, arch)
    tied = config.tie_word_embeddings
    for name, tensor in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        w = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            w = _llama_cpp_permute(w, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _llama_cpp_permute(w, config.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), w)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    finish(writer)


def _random_hf(config_name: str, **overrides):
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    return model


def _llama3_rope_freqs(hf_model) -> np.ndarray:
    """What llama.cpp writes for Llama 3.1: default inv_freq / llama3 inv_freq."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_model.config, torch.device("cpu"))
    head_dim = hf_model.config.head_dim
    base = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return (base / scaled).numpy()


CASES = {
    "llama_gqa": ("LlamaConfig", "llama", {}),
    "llama_untied": ("LlamaConfig", "llama", dict(num_key_value_heads=1)),
    "llama_tied": ("LlamaConfig", "llama", dict(tie_word_embeddings=True)),
    "llama3_rope_freqs": ("LlamaConfig", "llama", dict(rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", "qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "qwen3", dict(head_dim=32)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_gguf_matches_transformers(case, tmp_path):
    config_name, arch, overrides = CASES[case]
    hf = _random_hf(config_name, **overrides)
    rope_freqs = _llama3_rope_freqs(hf) if case == "llama3_rope_freqs" else None
    path = tmp_path / f"{case}.gguf"
    _write_gguf(hf, arch, path, rope_freqs)

    loaded = load_model(path, progress=False)
    assert loaded.is_gguf
    assert loaded.arch.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    assert loaded.arch.qk_norm == (arch == "qwen3")
    assert loaded.arch.attention_bias == (arch == "qwen2")
    assert (loaded.arch.bos_token_id, loaded.arch.eos_token_ids) == (1, (2,))

    torch.manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (20,))
    with torch.inference_mode():
        hidden = loaded.model(
            ids, torch.arange(20), lambda i, q, k, v: dense_causal_attention(q, k, v)
        )
        logits = loaded.model.compute_logits(hidden)
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4

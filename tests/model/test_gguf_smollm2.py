"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' GGUF loader.

The loader's error paths are checked here too; they need no weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvwise.models.layers import dense_causal_attention
from kvwise.models.loader import load_model

# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
# "The capital of France is", tokenized by the model's own tokenizer.
INPUT_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
INPUT_IDS += [504, 3575, 282, 4649, 314]


def _attn(layer_idx, q, k, v):
    return dense_causal_attention(q, k, v)


@pytest.fixture(scope="module")
def ours(smollm2):
    """Our load of the default GGUF (the session fixture in conftest.py)."""
    return smollm2


@pytest.fixture(scope="module")
def theirs(hf_smollm2):
    """transformers' load of the same file (the session fixture in conftest.py)."""
    return hf_smollm2


@pytest.mark.slow
def test_arch_from_gguf(ours):
    arch = ours.arch
    assert ours.is_gguf and ours.generation_config == {}
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.tie_word_embeddings and arch.vocab_size == 49152
    assert arch.rope_theta == 100000.0 and arch.max_position_embeddings == 8192
    assert arch.eos_token_ids == (2,) and arch.bos_token_id == 1
    assert len(ours.fingerprint) == 64


@pytest.mark.slow
def test_logits_and_greedy_tokens_match_transformers(ours, theirs):
    ids = torch.tensor(INPUT_IDS)
    with torch.inference_mode():
        logits = ours.model.compute_logits(ours.model(ids, torch.arange(len(ids)), _attn))
        expected = theirs(ids[None]).logits[0].float()
    assert (logits - expected).abs().max().item() < 3e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("layer_idx", [0, 17, 29])
def test_dequantized_weights_equal_transformers(ours, theirs, layer_idx):
    mine, ref = ours.model.layers[layer_idx], theirs.model.layers[layer_idx]
    arch = ours.arch
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, 1536
    # q/k rows un-permuted from llama.cpp's interleaved layout, bit for bit.
    assert torch.equal(mine.qkv_proj[:, :q].t(), ref.self_attn.q_proj.weight)
    assert torch.equal(mine.qkv_proj[:, q : q + kv].t(), ref.self_attn.k_proj.weight)
    assert torch.equal(mine.qkv_proj[:, q + kv :].t(), ref.self_attn.v_proj.weight)
    assert torch.equal(mine.o_proj.t(), ref.self_attn.o_proj.weight)
    assert torch.equal(mine.gate_up_proj[:, :inter].t(), ref.mlp.gate_proj.weight)
    assert torch.equal(mine.gate_up_proj[:, inter:].t(), ref.mlp.up_proj.weight)
    assert torch.equal(mine.down_proj.t(), ref.mlp.down_proj.weight)
    assert torch.equal(mine.input_norm, ref.input_layernorm.weight)
    assert torch.equal(mine.mlp_norm, ref.post_attention_layernorm.weight)


@pytest.mark.slow
def test_tied_embeddings(ours, theirs):
    model = ours.model
    assert torch.equal(model.embed, theirs.model.embed_tokens.weight)
    assert torch.equal(model.lm_head, model.embed.t())
    assert model.lm_head.is_contiguous()


@pytest.mark.slow
def test_directory_with_one_gguf(ours, tmp_path):
    (tmp_path / ours.source.name).symlink_to(ours.source)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.is_gguf and loaded.fingerprint == ours.fingerprint


# --- error paths (fast) --------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"model: path '.*nope' does not exist"):
        load_model(missing)


def test_unsupported_architecture(tmp_path):
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path)


def test_directory_without_model(tmp_path):
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(ValueError, match="no config.json and no .gguf file"):
        load_model(tmp_path)


def test_not_a_model_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither a model directory nor a .gguf file"):
        load_model(path)


def test_config_without_safetensors(tmp_path):
    config = {
        "model_type": "llama",
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no .safetensors"):
        load_model(tmp_path)

"""Tiny random-weight models: our loader + model must match transformers' logits.

Each case builds a 2-layer model with transformers, saves it as safetensors, loads it with
`load_model`, and compares logits over one sequence; then checks chunked (cached k/v) and packed
(varlen, two sequences) evaluation against the one-shot result.
"""

from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvwise.core.kv_spec import KVSpec  # noqa: E402
from kvwise.models.arch import RopeScaling  # noqa: E402
from kvwise.models.arch_load import arch_from_hf_config  # noqa: E402
from kvwise.models.layers import dense_causal_attention  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402

SEQ_LEN = 24
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
CASES = {
    "llama_mha": ("LlamaConfig", dict(num_key_value_heads=4)),
    "llama_gqa": ("LlamaConfig", dict(num_key_value_heads=2)),
    "llama_mqa": ("LlamaConfig", dict(num_key_value_heads=1)),
    "llama_tied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_bias": ("LlamaConfig", dict(num_key_value_heads=2, attention_bias=True)),
    "llama3_rope": ("LlamaConfig", dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)),
    "llama_linear_rope": (
        "LlamaConfig",
        dict(num_key_value_heads=2, rope_parameters=dict(rope_type="linear", factor=4.0)),
    ),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=16)),
    "qwen2_bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qk_norm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32)),
    "qwen3_bias": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=16, attention_bias=True)),
}


def _save_random_model(config_name: str, overrides: dict, directory) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**COMMON, **overrides)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Every weight random (biases and norms too) so a mis-mapped tensor cannot hide.
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    hf.save_pretrained(directory)
    return hf


class ConcatCache:
    """Test-side attention for one sequence fed in chunks: keeps every layer's k/v."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx, q, k, v):
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k])
            v = torch.cat([self.v[layer_idx], v])
        self.k[layer_idx], self.v[layer_idx] = k, v
        return dense_causal_attention(q, k, v, sliding_window=self.sliding_window)


def _dense(sliding_window: int | None = None):
    def attn(layer_idx, q, k, v):
        return dense_causal_attention(q, k, v, sliding_window=sliding_window)

    return attn


def _packed_attention(seq_lens: list[int], sliding_window: int | None = None):
    """Attention over sequences packed back to back in one flat batch."""

    def attn(layer_idx, q, k, v):
        outs, start = [], 0
        for n in seq_lens:
            end = start + n
            outs.append(
                dense_causal_attention(
                    q[start:end], k[start:end], v[start:end], sliding_window=sliding_window
                )
            )
            start = end
        return torch.cat(outs)

    return attn


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    config_name, overrides = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = _save_random_model(config_name, overrides, directory)
    loaded = load_model(directory, progress=False)
    torch.manual_seed(1)
    input_ids = torch.randint(0, COMMON["vocab_size"], (SEQ_LEN,))
    with torch.inference_mode():
        expected = hf(input_ids[None]).logits[0].float()  # (T, vocab)
    return request.param, loaded, input_ids, expected


def _run(model, input_ids, positions, attn) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, attn))


def test_logits_match_transformers(case):
    name, loaded, input_ids, expected = case
    window = loaded.arch.sliding_window
    logits = _run(loaded.model, input_ids, torch.arange(SEQ_LEN), _dense(window))
    assert logits.dtype == torch.float32
    assert logits.shape == (SEQ_LEN, COMMON["vocab_size"])
    diff = (logits - expected).abs().max().item()
    assert diff < 1e-4, f"{name}: max abs diff {diff}"


@pytest.mark.parametrize("split", [1, 10, SEQ_LEN - 1])
def test_chunked_with_cached_kv_matches(case, split):
    _, loaded, input_ids, expected = case
    cache = ConcatCache(loaded.arch.sliding_window)
    first = _run(loaded.model, input_ids[:split], torch.arange(split), cache)
    # The rest one token at a time for the first few, then as one chunk: prefill + decode.
    pieces = [first]
    pos = split
    while pos < SEQ_LEN:
        step = 1 if pos < split + 3 else SEQ_LEN - pos
        ids = input_ids[pos : pos + step]
        pieces.append(_run(loaded.model, ids, torch.arange(pos, pos + step), cache))
        pos += step
    logits = torch.cat(pieces)
    assert (logits - expected).abs().max().item() < 1e-4


def test_packed_sequences_match_separate_runs(case):
    _, loaded, input_ids, expected = case
    other = torch.flip(input_ids[:10], dims=[0])
    packed_ids = torch.cat([input_ids, other])
    positions = torch.cat([torch.arange(SEQ_LEN), torch.arange(10)])
    window = loaded.arch.sliding_window
    logits = _run(loaded.model, packed_ids, positions, _packed_attention([SEQ_LEN, 10], window))
    alone = _run(loaded.model, other, torch.arange(10), _dense(window))
    assert (logits[:SEQ_LEN] - expected).abs().max().item() < 1e-4
    assert (logits[SEQ_LEN:] - alone).abs().max().item() < 1e-5


def test_weights_are_transposed_contiguous(case):
    _, loaded, _, _ = case
    model, arch = loaded.model, loaded.arch
    layer = model.layers[0]
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    assert layer.qkv_proj.shape == (arch.hidden_size, q_size + 2 * kv_size)
    assert layer.gate_up_proj.shape == (arch.hidden_size, 2 * arch.intermediate_size)
    assert model.lm_head.shape == (arch.hidden_size, arch.vocab_size)
    for param in model.parameters():
        assert param.is_contiguous() and not param.requires_grad
    if arch.tie_word_embeddings:
        assert torch.equal(model.lm_head, model.embed.t())


def test_arch_flags(case):
    name, loaded, _, _ = case
    arch = loaded.arch
    assert arch.attention_bias == (name in ("qwen2_bias", "llama_bias", "qwen3_bias"))
    assert arch.o_proj_bias == (name in ("llama_bias", "qwen3_bias"))
    assert arch.qk_norm == name.startswith("qwen3")
    assert arch.tie_word_embeddings == (name in ("llama_tied", "qwen2_bias"))
    assert arch.sliding_window == (16 if name == "mistral" else None)
    if name == "llama3_rope":
        assert arch.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
        assert arch.rope_theta == 500000.0


def test_fingerprint_tracks_weights_and_dtype(tmp_path):
    _save_random_model("LlamaConfig", dict(num_key_value_heads=2), tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a = load_model(tmp_path / "a", progress=False)
    b = load_model(tmp_path / "b", progress=False)
    half = load_model(tmp_path / "a", dtype=torch.bfloat16, progress=False)
    assert a.fingerprint == b.fingerprint
    assert half.fingerprint != a.fingerprint
    assert half.model.embed.dtype == torch.bfloat16
    assert a.generation_config.get("eos_token_id") == 2
    _save_random_model("LlamaConfig", dict(num_key_value_heads=1), tmp_path / "c")
    assert load_model(tmp_path / "c", progress=False).fingerprint != a.fingerprint


def test_bfloat16_runs_close_to_float32(tmp_path):
    _save_random_model("Qwen3Config", dict(num_key_value_heads=2, head_dim=32), tmp_path)
    ids = torch.arange(12)
    full = load_model(tmp_path, progress=False).model
    half = load_model(tmp_path, dtype=torch.bfloat16, progress=False).model
    ref = _run(full, ids, torch.arange(12), _dense())
    out = _run(half, ids, torch.arange(12), _dense())
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() < 0.1 * ref.abs().max().item()


# --- ModelArchConfig validation (no weights) -----------------------------------------------


def _hf_dict(**overrides):
    config = dict(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config.update(overrides)
    return config


def test_arch_from_hf_config_defaults_and_kv_bytes():
    arch = arch_from_hf_config(_hf_dict(eos_token_id=[2, 3], rope_theta=1e6))
    assert arch.architecture == "LlamaForCausalLM"
    assert arch.head_dim == 16 and arch.rope_theta == 1e6 and arch.rope_scaling is None
    assert arch.eos_token_ids == (2, 3)
    spec = KVSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, 16, "float32")
    assert spec.bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_arch_old_style_rope_scaling():
    scaling = dict(type="linear", factor=2.0)
    arch = arch_from_hf_config(_hf_dict(rope_scaling=scaling))
    assert arch.rope_scaling == RopeScaling("linear", factor=2.0)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "unsupported architecture"),
        (dict(num_key_value_heads=3), "num_kv_heads"),
        (dict(rope_parameters=dict(rope_type="longrope", factor=2.0)), "rope type .longrope."),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(hidden_size=0), "hidden_size"),
    ],
)
def test_arch_rejects_bad_configs(overrides, match):
    with pytest.raises(ValueError, match=match):
        arch_from_hf_config(_hf_dict(**overrides))


def test_arch_missing_field_is_value_error():
    config = _hf_dict()
    del config["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        arch_from_hf_config(config)

"""``quantization="auto"`` on GGUF files whose tensors mix block types, as Q4_K_M files do.

Tiny random models of each supported architecture (hidden 256: K-quants need rows of whole
super-blocks), every linear weight, the embedding and the head in a different type, written
with the ``gguf`` package from valid random blocks. ``auto`` must run each at the file's own
precision (the report says "exact") and give logits close to the file's exact dequantization
(``quantization="none"``, itself checked against transformers elsewhere), the difference being
only the activations' int8 rounding; and an engine on such a file must give the same greedy
tokens cold, from the prefix cache and from the disk tier.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine
from kvwise.models.default import default_model_path
from kvwise.models.gguf_load import ConcatWeight
from kvwise.models.gguf_weights import open_gguf
from kvwise.models.layers import dense_causal_attention
from kvwise.models.loader import load_model
from tests.gguf_blocks_util import random_blocks
from tests.tiers_util import evict_device, run

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 96
# a type per tensor: q/k/v in three types (a fused weight of mixed parts), gate/up alike
TYPES = {
    "attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q5_K", "attn_output": "Q3_K",
    "ffn_gate": "Q2_K", "ffn_up": "Q2_K", "ffn_down": "Q5_1",
}  # fmt: skip
SHAPES = {
    "attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN),
    "attn_v": (KV_HEADS * 64, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
    "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER),
}  # fmt: skip


def _quant(writer, name: str, kind: str, shape, rng) -> None:
    raw = random_blocks(kind, *shape, rng)
    writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])


# a mixture of experts' tensors (qwen2moe, qwen3moe): per layer, the experts' types (gate and
# up of different types in layer 0: two weights side by side; MXFP4, gpt-oss's type, in layer 1) and
# the shared expert's
EXPERTS, EXPERT_INTER = 4, 256
EXPERT_TYPES = [
    {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q5_K", "ffn_down_exps": "Q6_K"},
    {"ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "Q8_0"},
]
SHARED_TYPES = {"ffn_gate_shexp": "Q8_0", "ffn_up_shexp": "Q8_0", "ffn_down_shexp": "Q4_0"}


def _write_experts(writer, layer: int, shared: bool, rng) -> None:
    writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                      rng.normal(0, 0.2, (EXPERTS, HIDDEN)).astype(np.float32))  # fmt: skip
    for part, kind in EXPERT_TYPES[layer % 2].items():
        out, inp = (HIDDEN, EXPERT_INTER) if part == "ffn_down_exps" else (EXPERT_INTER, HIDDEN)
        raw = np.stack([random_blocks(kind, out, inp, rng) for _ in range(EXPERTS)])
        writer.add_tensor(f"blk.{layer}.{part}.weight", raw,
                          raw_dtype=gguf.GGMLQuantizationType[kind])  # fmt: skip
    if shared:
        for part, kind in SHARED_TYPES.items():
            down = part == "ffn_down_shexp"
            shape = (HIDDEN, EXPERT_INTER) if down else (EXPERT_INTER, HIDDEN)
            _quant(writer, f"blk.{layer}.{part}.weight", kind, shape, rng)
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp_shexp.weight",
                          rng.normal(0, 0.2, HIDDEN).astype(np.float32))  # fmt: skip


def write_mixed_gguf(path, arch: str, vocab=VOCAB, tokenizer_from=None, seed=0) -> None:
    """A tiny model of ``arch`` in mixed block types (qwen2moe / qwen3moe: experts in place of
    the MLP, ``EXPERT_TYPES``); ``tokenizer_from``: a GGUF whose tokenizer to copy (else none)."""
    rng = np.random.default_rng(seed)
    moe = arch in ("qwen2moe", "qwen3moe")
    writer = gguf.GGUFWriter(path, arch=arch)
    if moe:
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(EXPERT_INTER)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(EXPERT_INTER)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    if tokenizer_from is not None:
        _copy_tokenizer(writer, tokenizer_from)
    else:
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    tied = arch == "qwen2"
    _quant(writer, "token_embd.weight", "Q6_K", (vocab, HIDDEN), rng)
    if not tied:
        _quant(writer, "output.weight", "Q8_0", (vocab, HIDDEN), rng)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    for i in range(LAYERS):
        for part, kind in TYPES.items():
            if not (moe and part.startswith("ffn_")):
                _quant(writer, f"blk.{i}.{part}.weight", kind, SHAPES[part], rng)
        if moe:
            _write_experts(writer, i, arch == "qwen2moe", rng)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight",
                              rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))  # fmt: skip
        if arch in ("qwen2", "qwen2moe"):
            for part in ("attn_q", "attn_k", "attn_v"):
                rows = SHAPES[part][0]
                writer.add_tensor(f"blk.{i}.{part}.bias",
                                  rng.normal(0, 0.1, rows).astype(np.float32))  # fmt: skip
        if arch in ("qwen3", "qwen3moe"):
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{i}.{norm}.weight",
                                  rng.uniform(0.5, 1.5, 64).astype(np.float32))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_tokenizer(writer, source) -> None:
    reader = open_gguf(source)

    def field(key):
        return reader.fields[key].contents()

    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(field("tokenizer.ggml.tokens"))
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))


def _logits(loaded, ids):
    with torch.inference_mode():
        hidden = loaded.model(
            ids, torch.arange(len(ids)), lambda i, q, k, v: dense_causal_attention(q, k, v)
        )
        return loaded.model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_types_run_exactly_and_match_the_dequantized_file(arch, tmp_path, caplog):
    path = tmp_path / f"{arch}.gguf"
    write_mixed_gguf(path, arch)
    with caplog.at_level(logging.WARNING, logger="kvwise"):
        auto = load_model(path, progress=False, quantization="auto")
    assert not [r for r in caplog.records if "converted" in r.getMessage()]
    exact = load_model(path, progress=False, quantization="none")
    assert auto.weight_format == "gguf"
    report = {row.gguf_type: row for row in auto.weight_report}
    assert set(report) >= set(TYPES.values()) | {"Q6_K", "F32"}
    assert all(row.runs_as.endswith("(exact)") for row in report.values())
    layer = auto.model.layers[0]
    assert isinstance(layer.quant["qkv_proj"], ConcatWeight)  # three types side by side
    assert not isinstance(layer.quant["gate_up_proj"], ConcatWeight)  # one type: one weight
    # each weight the file's own: the fused q/k/v equal to the float path's, exactly
    assert torch.equal(layer.quant["qkv_proj"].dequantize(), exact.model.layers[0].qkv_proj.t())
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1))
    got, want = _logits(auto, ids), _logits(exact, ids)
    # the activations' int8 rounding only (measured: 0.8-1.5% of the logits' norm)
    assert (got - want).norm() / want.norm() < 0.04
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_an_inexact_type_is_converted_upwards_and_logged(tmp_path, caplog):
    """IQ4_NL has no kernel: it runs as int8 blocks (8.5 bits a weight against its 4.5)."""
    path = tmp_path / "iq.gguf"
    rng = np.random.default_rng(0)
    write_mixed_gguf(path, "llama")
    reader = open_gguf(path)  # the same model with one tensor rewritten as IQ4_NL
    writer = gguf.GGUFWriter(tmp_path / "iq2.gguf", arch="llama")
    for key, field in reader.fields.items():
        if key.startswith(("general.", "llama.")) and key != "general.architecture":
            writer.add_key_value(key, field.contents(), field.types[0])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for tensor in reader.tensors:
        if tensor.name == "blk.0.ffn_down.weight":
            raw = rng.integers(0, 256, (HIDDEN * INTER // 32, 18), dtype=np.uint8)
            raw[:, 0:2] = np.full(len(raw), 0.01, np.float16).view(np.uint8).reshape(-1, 2)
            writer.add_tensor(tensor.name, raw.reshape(HIDDEN, -1),
                              raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)  # fmt: skip
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data),
                              raw_dtype=tensor.tensor_type)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with caplog.at_level(logging.WARNING, logger="kvwise"):
        loaded = load_model(tmp_path / "iq2.gguf", progress=False, quantization="auto")
    report = {row.gguf_type: row.runs_as for row in loaded.weight_report}
    assert report["IQ4_NL"] == "Q8_0 (converted)"
    assert any("IQ4_NL" in r.getMessage() and "Q8_0" in r.getMessage() for r in caplog.records)
    exact = load_model(tmp_path / "iq2.gguf", progress=False, quantization="none")
    down = loaded.model.layers[0].quant["down_proj"].dequantize()
    want = exact.model.layers[0].down_proj.t()
    assert (down - want).abs().max() <= want.abs().max() / 254 + 1e-7  # half an int8 step


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    vocab = open_gguf(default_model_path()).fields["tokenizer.ggml.tokens"].contents()
    write_mixed_gguf(path, "llama", vocab=len(vocab), tokenizer_from=default_model_path())
    return path


def test_engine_greedy_identical_cold_cached_and_from_disk(mixed_file, tmp_path):
    config = EngineConfig.from_kwargs(
        model=str(mixed_file), quantization="auto", kv_cache_memory="64MiB",
        kv_host_memory="off", kv_disk_path=str(tmp_path), enable_prefix_caching=True,
    )  # fmt: skip
    engine = build_engine(config, progress=False)
    cold = run(engine)
    cached = run(engine)
    assert cached.num_cached_tokens > 0 and cached.token_ids == cold.token_ids
    evict_device(engine)
    loaded = run(engine)
    assert loaded.num_loaded_tokens > 0 and loaded.token_ids == cold.token_ids
    engine.close()
    plain = build_engine(EngineConfig.from_kwargs(
        model=str(mixed_file), quantization="auto", kv_cache_memory="64MiB",
        kv_host_memory="off", kv_disk_path="off", enable_prefix_caching=False,
    ), progress=False)  # fmt: skip
    assert run(plain).token_ids == cold.token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2moe"])
def test_kvwise_size_predicts_the_resident_weights(arch, tmp_path):
    """``kvwise size``'s weight table (torch-free, from the tensor list) is what loading holds."""
    from kvwise.models.gguf_file import GGUFFile
    from kvwise.models.gguf_types import resident_bytes

    path = tmp_path / f"{arch}.gguf"
    write_mixed_gguf(path, arch)
    reader = GGUFFile(path)
    infos = [(t.name, t.tensor_type.name, int(t.n_elements)) for t in reader.tensors]
    predicted = resident_bytes(infos, tied=arch == "qwen2", heads=(HEADS, KV_HEADS))
    loaded = load_model(path, progress=False, quantization="auto")
    assert sum(predicted.values()) == loaded.model.weight_bytes()
    held = {(row.gguf_type, row.runs_as): row.resident_bytes for row in loaded.weight_report}
    assert held == dict(predicted)


def test_float32_path_is_transformers_on_a_k_quant_file(mixed_file):
    """``quantization="none"`` on the mixed-type file: the logits and greedy tokens of
    transformers' own GGUF loader on the same file."""
    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        mixed_file.parent, gguf_file=mixed_file.name, dtype=torch.float32
    ).eval()
    ours = load_model(mixed_file, progress=False, quantization="none")
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = _logits(ours, ids)
        want = theirs(ids[None]).logits[0].float()
    assert (got - want).abs().max() / want.abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))

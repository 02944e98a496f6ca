"""gpt-oss (issue 48): a tiny random model of transformers' own ``GptOssForCausalLM`` — sliding
windows of 8 on alternate layers, a learned sink per head, YaRN rotary, q/k/v/o biases, four
experts a layer routed top-2 then softmaxed, biased experts behind the clamped SwiGLU (its
limit set low, so the clamp bites on these weights) — saved as an HF checkpoint (its experts
fused and gate/up interleaved, as released). kvwise's ``quantization="none"`` path must give
transformers' logits (eager attention, the one that computes sinks) and greedy tokens: alone
and batched, cold, from the device pool and from the disk tier, with prompts and answers
past the window; every KV format runs the sinks in its kernel."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvwise import LLM, SamplingParams, kernels  # noqa: E402
from kvwise.models.layers import dense_causal_attention  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from tests.model.test_engine_vs_hf import hf_greedy  # noqa: E402
from tests.model.test_model_family import _write_tokenizer  # noqa: E402
from tests.model.test_models_tiny import COMMON, _run  # noqa: E402
from tests.tiers_util import evict_device  # noqa: E402

NUM_NEW = 20
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 70)), [120, 8, 8, 61, 30, 7, 99]]  # 67 tokens: past the window
WINDOW = 8
CONFIG = dict(
    COMMON,
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 2,
    rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
        truncate=False, original_max_position_embeddings=64,
    ),
    swiglu_limit=0.5,
    attention_bias=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**CONFIG)
    config._attn_implementation = "eager"  # the implementation that adds the sinks
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():  # every tensor random, biases and sinks too
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.1)
    hf.save_pretrained(directory)
    _write_tokenizer(directory)
    reference = [hf_greedy(hf, ids, NUM_NEW) for ids in PROMPTS]
    return directory, hf, reference


def _attention(loaded):
    """Each layer's window and sinks, over one whole sequence."""
    kinds, layers = loaded.model.attention_kinds, loaded.model.layers

    def attn(i, q, k, v):
        window = kinds[i].sliding_window
        return dense_causal_attention(q, k, v, sliding_window=window, sinks=layers[i].sinks)

    return attn


def test_logits_match_transformers(gpt_oss):
    directory, hf, _ = gpt_oss
    loaded = load_model(directory, progress=False)
    arch = loaded.arch
    assert arch.routing == "topk_softmax" and arch.expert_glu == "swiglu_clamped"
    assert arch.rope_scaling.rope_type == "yarn" and arch.attention_sinks
    assert [k.sliding_window for k in loaded.model.attention_kinds] == [WINDOW, None] * 2
    ids = torch.randint(0, COMMON["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0].float()
    logits = _run(loaded.model, ids, torch.arange(40), _attention(loaded))
    assert (logits - expected).abs().max().item() < 1e-4
    # the clamp, the sinks and the interleaving each matter: without any, other logits
    moe = loaded.model.layers[0].moe
    moe.glu = None  # the family's plain SiLU gate
    plain = _run(loaded.model, ids, torch.arange(40), _attention(loaded))
    assert (plain - expected).abs().max().item() > 1e-2


@pytest.mark.parametrize("kv", ["float32", "int8", "int4"])
def test_greedy_tokens_alone_batched_cached_and_from_disk(gpt_oss, kv, tmp_path):
    """float32 KV: transformers' greedy tokens; int8 / int4 KV (the sinks in their kernels):
    the same tokens whichever way the KV was had, alone or batched."""
    directory, _, reference = gpt_oss
    with LLM(
        model=str(directory),
        quantization="none",
        kv_cache_dtype=kv,
        progress=False,
        kv_cache_memory="8MiB",
        kv_host_memory="off",
        kv_disk_path=str(tmp_path),
        kv_store_min_tokens=16,
    ) as llm:
        batched = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        if kv == "float32":
            assert batched == reference
        alone = [llm.generate([p], GREEDY)[0] for p in PROMPTS]  # the first: a pool hit
        assert [out.token_ids for out in alone] == batched
        assert alone[0].num_cached_tokens >= 48
        evict_device(llm.engine)
        loaded = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert loaded.num_loaded_tokens >= 48 and loaded.token_ids == batched[0]


# the tiny model as llama.cpp's converter writes a gpt-oss GGUF: names (post_attention_norm for
# the MLP's input norm, attn_sinks, the router's and experts' biases), experts split into gate
# and up (de-interleaved) and stacked, metadata (expert counts, window, YaRN)
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    **{f"self_attn.{p}_proj.{w}": f"attn_{g}.{w}" for p, g in
       (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for w in ("weight", "bias")},
}  # fmt: skip


def write_gpt_oss_gguf(hf, path, experts: str = "F32") -> None:
    """``experts``: "F32", or "MXFP4" (quantized with the gguf package, as llama.cpp's tools
    hold gpt-oss's experts)."""
    import gguf
    import numpy as np

    config, writer = hf.config, gguf.GGUFWriter(path, arch="gpt-oss")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    writer.add_float32("gpt-oss.swiglu_clamp_exp", config.swiglu_limit)  # llama.cpp: 7 if absent
    # a byte-level BPE vocabulary of the model's 128 tokens: one character each, no merges
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(0x100 + i) if i < 33 else chr(i) for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name, w, quantize=False):
        if quantize and experts == "MXFP4":
            raw = gguf.quants.quantize(np.ascontiguousarray(w), gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))

    for name, tensor in hf.state_dict().items():
        w = tensor.detach().float().numpy()
        if name in _GGUF_NAMES:
            add(_GGUF_NAMES[name], w)
            continue
        _, _, i, within = name.split(".", 3)
        if within == "mlp.experts.gate_up_proj":  # (E, hidden, 2 inter) [in, out], interleaved
            add(f"blk.{i}.ffn_gate_exps.weight", w[:, :, ::2].transpose(0, 2, 1), True)
            add(f"blk.{i}.ffn_up_exps.weight", w[:, :, 1::2].transpose(0, 2, 1), True)
        elif within == "mlp.experts.gate_up_proj_bias":
            add(f"blk.{i}.ffn_gate_exps.bias", w[:, ::2])
            add(f"blk.{i}.ffn_up_exps.bias", w[:, 1::2])
        elif within == "mlp.experts.down_proj":  # (E, inter, hidden) [in, out]
            add(f"blk.{i}.ffn_down_exps.weight", w.transpose(0, 2, 1), True)
        elif within == "mlp.experts.down_proj_bias":
            add(f"blk.{i}.ffn_down_exps.bias", w)
        else:
            add(f"blk.{i}.{_GGUF_LAYER[within]}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gpt_oss_gguf_is_transformers(gpt_oss, tmp_path):
    directory, hf, _ = gpt_oss
    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(hf, path)
    loaded = load_model(path, progress=False, quantization="none")
    from_hf = load_model(directory, progress=False).arch
    same = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=1e-6)  # (float32 in a GGUF)
    assert loaded.arch.replace(**same) == from_hf.replace(**same)
    ids = torch.randint(0, COMMON["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0].float()
    logits = _run(loaded.model, ids, torch.arange(40), _attention(loaded))
    assert (logits - expected).abs().max().item() < 1e-4


def test_mxfp4_experts_at_their_own_type(gpt_oss, tmp_path):
    """MXFP4 experts (and their biases) on the MXFP4 kernel, stacked: logits within the
    activations' int8 rounding of the file's float dequantization, and the same greedy tokens
    cold, from the pool and from the disk tier."""
    _, hf, _ = gpt_oss
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    write_gpt_oss_gguf(hf, path, experts="MXFP4")
    auto = load_model(path, progress=False, quantization="auto")
    exact = load_model(path, progress=False, quantization="none")
    assert {row.gguf_type: row.runs_as for row in auto.weight_report}["MXFP4"] == "MXFP4 (exact)"
    stacked = kernels.available()  # the experts' stacks are the kernels'
    assert all((layer.moe.stacks is not None) == stacked for layer in auto.model.layers)
    ids = torch.randint(0, COMMON["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    got = _run(auto.model, ids, torch.arange(40), _attention(auto))
    want = _run(exact.model, ids, torch.arange(40), _attention(exact))
    assert (got - want).norm() / want.norm() < 0.04
    with LLM(model=str(path), quantization="auto", progress=False, kv_cache_memory="8MiB",
             kv_host_memory="off", kv_disk_path=str(tmp_path), kv_store_min_tokens=16) as llm:  # fmt: skip
        cold = llm.generate([PROMPTS[0]], GREEDY)[0]
        cached = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert cached.num_cached_tokens >= 48 and cached.token_ids == cold.token_ids
        evict_device(llm.engine)
        disk = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert disk.num_loaded_tokens >= 48 and disk.token_ids == cold.token_ids

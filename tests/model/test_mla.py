"""Multi-head latent attention (issue 48): tiny random DeepSeek-V2 (V2-Lite's form: full-rank
queries, softmax greedy routing, a dense first layer, shared experts) and DeepSeek-V3 (low-rank
queries, sigmoid routing with a correction bias, group-limited, renormalised and scaled; YaRN
with its mscale on the softmax scale) built with transformers' own classes and saved as HF
checkpoints. kvwise caches one latent row a token and layer (1 KV head of kv_lora_rank +
qk_rope_head_dim) and attends with absorbed projections; ``quantization="none"`` must give
transformers' logits and greedy tokens, alone and batched, cold, from the pool and from the
disk tier; int8 KV's accuracy against float32 KV is measured (KL, top-1)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvwise import LLM, SamplingParams  # noqa: E402
from kvwise.models.layers import dense_causal_attention  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from kvwise.models.mla import MLALayer  # noqa: E402
from tests.model.test_engine_vs_hf import hf_greedy  # noqa: E402
from tests.model.test_model_family import _write_tokenizer  # noqa: E402
from tests.model.test_models_tiny import COMMON, _run  # noqa: E402
from tests.tiers_util import evict_device  # noqa: E402

NUM_NEW = 16
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 70)), [120, 8, 8, 61, 30, 7, 99]]
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
           num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32,
           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1)  # fmt: skip
CASES = {
    "deepseek_v2": ("DeepseekV2Config", dict(MLA, q_lora_rank=None, topk_method="greedy")),
    "deepseek_v3": ("DeepseekV3Config", dict(
        MLA, q_lora_rank=32, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
                             mscale=1.0, mscale_all_dim=0.8),
    )),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    config_name, overrides = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON, **overrides})
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.1)
        for name, buffer in hf.named_buffers():  # V3's routing correction bias
            if "e_score_correction_bias" in name:
                buffer.normal_(0.0, 0.1)
    hf.save_pretrained(directory)
    _write_tokenizer(directory)
    reference = [hf_greedy(hf, ids, NUM_NEW) for ids in PROMPTS]
    return request.param, directory, hf, reference


def _attention(loaded):
    kinds = loaded.model.attention_kinds

    def attn(i, q, k, v):
        return dense_causal_attention(q, k, v, scale=kinds[i].softmax_scale)

    return attn


def test_logits_match_transformers(case):
    name, directory, hf, _ = case
    loaded = load_model(directory, progress=False)
    arch = loaded.arch
    assert (arch.num_kv_heads, arch.head_dim) == (1, 32 + 8)  # the latent row
    assert all(isinstance(layer, MLALayer) for layer in loaded.model.layers)
    assert loaded.model.layers[0].moe is None and loaded.model.layers[1].moe is not None
    ids = torch.randint(0, COMMON["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0].float()
    logits = _run(loaded.model, ids, torch.arange(40), _attention(loaded))
    assert (logits - expected).abs().max().item() < 1e-4, name


def test_greedy_tokens_alone_batched_cached_and_from_disk(case, tmp_path):
    name, directory, _, reference = case
    with LLM(model=str(directory), quantization="none", progress=False, kv_cache_memory="8MiB",
             kv_host_memory="off", kv_disk_path=str(tmp_path), kv_store_min_tokens=16) as llm:  # fmt: skip
        assert llm.engine.runner.spec.bytes_per_token == 3 * 2 * 40 * 4  # 1 head of 40, K and V
        batched = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        assert batched == reference, name
        alone = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
        assert [out.token_ids for out in alone] == reference
        assert alone[0].num_cached_tokens >= 48
        evict_device(llm.engine)
        loaded = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert loaded.num_loaded_tokens >= 48 and loaded.token_ids == reference[0]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_stay_close_batch_invariant_and_cache_identical(case, quantization):
    """int8 / int4 projections and experts (kv_b_proj float): logits close to the float
    model's, fewer bytes, a token's logprobs the same alone and batched, the same greedy tokens
    cold and from the pool."""
    name, directory, _, _ = case
    quantized = load_model(directory, progress=False, quantization=quantization)
    floats = load_model(directory, progress=False)
    layers = quantized.model.layers
    assert all(layer.quant and layer.w_uk is not None for layer in layers)
    assert all(layer.moe.quant is not None for layer in layers if layer.moe is not None)
    assert quantized.model.weight_bytes() < floats.model.weight_bytes()
    ids = torch.randint(0, COMMON["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    reference = _run(floats.model, ids, torch.arange(40), _attention(floats))
    logits = _run(quantized.model, ids, torch.arange(40), _attention(quantized))
    error = ((logits - reference).norm() / reference.norm()).item()
    # (random N(0, 0.1) weights of 32-wide inputs, one int4 group a row: 0.2-0.43 measured;
    # a mis-mapped projection gives an error near 1)
    assert error < (0.06 if quantization == "int8" else 0.5), (name, error)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    engine = dict(progress=False, kv_cache_memory="8MiB", kv_host_memory="off", kv_disk_path="off")
    with LLM(model=str(directory), quantization=quantization, **engine) as llm:
        alone = llm.generate([PROMPTS[1]], params)[0]
        together = llm.generate([PROMPTS[0], PROMPTS[1]], params)
        again = llm.generate([PROMPTS[0]], params)[0]
    assert alone.token_ids == together[1].token_ids and alone.logprobs == together[1].logprobs
    assert again.num_cached_tokens >= 48 and again.token_ids == together[0].token_ids

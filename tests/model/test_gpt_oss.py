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

from kvwise import LLM, SamplingParams  # noqa: E402
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
    swiglu_limit=0.3,
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

"""Mixture-of-experts families (issue 48): tiny random Qwen2-MoE (a shared expert behind its
gate, one dense layer), Qwen3-MoE (renormalised top-k, q/k norm) and Mixtral, built with
transformers' own classes and saved as HF checkpoints. kvwise's ``quantization="none"`` path
must give transformers' logits and greedy tokens: alone and batched, cold, from the device
pool and from the disk tier; and a token's logprobs must not depend on its batch."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvwise import LLM, SamplingParams  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from kvwise.models.moe import MoEWeights  # noqa: E402
from tests.model.test_engine_vs_hf import hf_greedy  # noqa: E402
from tests.model.test_model_family import _write_tokenizer  # noqa: E402
from tests.model.test_models_tiny import COMMON, SEQ_LEN, _dense, _run, _save_random_model  # noqa: E402
from tests.tiers_util import evict_device  # noqa: E402

NUM_NEW = 20
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
# the first prompt spans several 16-token blocks, so a second run hits the pool / the tier
PROMPTS = [list(range(3, 70)), [120, 8, 8, 61, 30, 7, 99]]
CASES = {
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    config_name, overrides = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = _save_random_model(config_name, overrides, directory)
    _write_tokenizer(directory)
    reference = [hf_greedy(hf, ids, NUM_NEW) for ids in PROMPTS]
    return request.param, directory, hf, reference


def test_logits_match_transformers(case):
    name, directory, hf, _ = case
    loaded = load_model(directory, progress=False)
    moe = [layer.moe for layer in loaded.model.layers]
    assert all(isinstance(m, MoEWeights) for m in moe[: 1 if name == "qwen2_moe" else 2])
    if name == "qwen2_moe":  # mlp_only_layers=[1]: a dense MLP there
        assert moe[1] is None and loaded.model.layers[1].gate_up_proj is not None
        assert moe[0].shared_gate is not None
    torch.manual_seed(1)
    input_ids = torch.randint(0, COMMON["vocab_size"], (SEQ_LEN,))
    with torch.inference_mode():
        expected = hf(input_ids[None]).logits[0].float()
    logits = _run(loaded.model, input_ids, torch.arange(SEQ_LEN), _dense())
    assert (logits - expected).abs().max().item() < 1e-4, name


def test_greedy_tokens_are_transformers_alone_batched_cached_and_from_disk(case, tmp_path):
    name, directory, _, reference = case
    with LLM(
        model=str(directory),
        quantization="none",
        progress=False,
        kv_cache_memory="8MiB",
        kv_host_memory="off",
        kv_disk_path=str(tmp_path),
        kv_store_min_tokens=16,
    ) as llm:
        batched = llm.generate(PROMPTS, GREEDY)
        assert [out.token_ids for out in batched] == reference, name
        alone = [llm.generate([p], GREEDY)[0] for p in PROMPTS]  # the first: a pool hit
        assert [out.token_ids for out in alone] == reference
        assert alone[0].num_cached_tokens >= 64
        evict_device(llm.engine)
        loaded = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert loaded.num_loaded_tokens >= 64 and loaded.token_ids == reference[0]


def test_a_tokens_logprobs_do_not_depend_on_its_batch(case):
    """Each token's experts and sums depend on the token alone: its sampled logprobs are the
    same bits alone and beside another prompt (prefill and decode rows)."""
    _, directory, _, _ = case
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    engine = dict(progress=False, kv_cache_memory="8MiB", kv_host_memory="off", kv_disk_path="off")
    with LLM(
        model=str(directory), quantization="none", enable_prefix_caching=False, **engine
    ) as llm:
        alone = llm.generate([PROMPTS[1]], params)[0]
        together = llm.generate([PROMPTS[0], PROMPTS[1]], params)[1]
    assert alone.token_ids == together.token_ids
    assert [lp for lp in alone.logprobs] == [lp for lp in together.logprobs]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_stay_close_batch_invariant_and_cache_identical(case, quantization):
    """int8 / int4 experts (each its own quantized weight, the router float): logits close to
    the float model's, a token's logprobs the same alone and batched, and the same greedy
    tokens cold and from the pool."""
    name, directory, _, _ = case
    quantized = load_model(directory, progress=False, quantization=quantization)
    moe = [layer.moe for layer in quantized.model.layers if layer.moe is not None]
    assert moe and all(m.quant is not None and m.gate_up is None for m in moe)
    assert (
        quantized.model.weight_bytes() < load_model(directory, progress=False).model.weight_bytes()
    )
    torch.manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (SEQ_LEN,))
    reference = _run(
        load_model(directory, progress=False).model, ids, torch.arange(SEQ_LEN), _dense()
    )
    logits = _run(quantized.model, ids, torch.arange(SEQ_LEN), _dense())
    error = ((logits - reference).norm() / reference.norm()).item()
    # (random N(0, 0.1) weights: a mis-mapped expert gives an error near 1)
    assert error < (0.06 if quantization == "int8" else 0.4), (name, error)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    engine = dict(progress=False, kv_cache_memory="8MiB", kv_host_memory="off", kv_disk_path="off")
    with LLM(model=str(directory), quantization=quantization, **engine) as llm:
        alone = llm.generate([PROMPTS[1]], params)[0]
        together = llm.generate([PROMPTS[0], PROMPTS[1]], params)
        again = llm.generate([PROMPTS[0]], params)[0]  # its prompt's blocks from the pool
    assert alone.token_ids == together[1].token_ids and alone.logprobs == together[1].logprobs
    assert again.num_cached_tokens >= 64 and again.token_ids == together[0].token_ids

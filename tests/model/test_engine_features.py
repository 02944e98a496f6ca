"""Engine features on the real default model: sampling, seeds, streaming, stop strings,
logprobs, errors, the offline API."""

import math

import pytest
import torch

from kvwise.engine.llm import LLM
from kvwise.types import FinishReason, SamplingParams
from kvwise.worker.sampler import apply_filters, sample
from tests.fakes import run_all


def collect(engine, prompts, params):
    return run_all(engine, prompts, params)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def test_seeded_sampling_reproducible_alone_and_batched(engine):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    (alone,) = collect(engine, ["Tell me a story about a dragon."], params)
    batched = collect(engine, ["Tell me a story about a dragon.", "Other prompt", "x y z"], params)
    assert batched[0].token_ids == alone.token_ids
    other = collect(
        engine,
        ["Tell me a story about a dragon."],
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99),
    )
    assert other[0].token_ids != alone.token_ids


def test_top_k_1_is_greedy(engine):
    greedy = collect(engine, ["The sky is"], SamplingParams(max_tokens=12, temperature=0))
    topk = collect(engine, ["The sky is"], SamplingParams(max_tokens=12, temperature=1.5, top_k=1))
    assert greedy[0].token_ids == topk[0].token_ids


def test_logprobs_are_those_of_chosen_tokens(engine, smollm2):
    (out,) = collect(engine, ["Hello, my name is"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out.logprobs) == 4
    assert all(lp <= 0 for lp in out.logprobs)
    # recompute the first one directly from the model
    from kvwise.models.layers import dense_causal_attention

    ids = torch.tensor(out.prompt_token_ids)
    with torch.inference_mode():
        hidden = smollm2.model(
            ids, torch.arange(len(ids)), lambda i, q, k, v: dense_causal_attention(q, k, v)
        )
        logits = smollm2.model.compute_logits(hidden[-1:])
    expected = torch.log_softmax(logits, -1)[0, out.token_ids[0]].item()
    assert math.isclose(out.logprobs[0], expected, abs_tol=1e-4)


def test_stream_deltas_add_up_and_stop_string(engine):
    params = SamplingParams(max_tokens=40, temperature=0)
    (full,) = collect(engine, ["Count: 1, 2, 3, 4,"], params)
    assert " 6" in full.text
    stop = SamplingParams(max_tokens=40, temperature=0, stop=(" 6",))
    (cut,) = collect(engine, ["Count: 1, 2, 3, 4,"], stop)
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(" 6")]
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_stop_token_ids_and_eos(engine):
    (full,) = collect(engine, ["Count: 1, 2, 3, 4,"], SamplingParams(max_tokens=8, temperature=0))
    stop_id = full.token_ids[3]
    (out,) = collect(
        engine,
        ["Count: 1, 2, 3, 4,"],
        SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_id,)),
    )
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert out.finish_reason is FinishReason.STOP
    chat = [{"role": "user", "content": "Say hi."}]
    (out,) = collect(engine, [chat], SamplingParams(max_tokens=200, temperature=0))
    assert out.finish_reason is FinishReason.STOP and out.token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in out.text


def test_prompt_over_context_is_rejected(make_engine):
    small = make_engine(max_model_len=32)
    with pytest.raises(ValueError, match="^prompt:"):
        small.add_request("word " * 40)
    with pytest.raises(ValueError, match="^prompt:"):
        small.add_request([])
    with pytest.raises(ValueError, match="^prompt:"):
        small.add_request([10**9])
    (out,) = collect(
        small, ["word " * 20], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    )
    assert out.finish_reason is FinishReason.LENGTH
    assert out.num_prompt_tokens + len(out.token_ids) == 32


def test_sampler_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    f = apply_filters(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isinf(f[2:]).all() and not torch.isinf(f[:2]).any()
    f = apply_filters(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert not torch.isinf(f[0]) and torch.isinf(f[1:]).all()
    f = apply_filters(logits, SamplingParams(temperature=1.0, min_p=0.3))
    p = logits.softmax(-1)
    assert (torch.isinf(f) == (p < 0.3 * p.max())).all()
    picked = sample(logits.unsqueeze(0), [SamplingParams(temperature=0)], [0])
    ids, lps = picked.token_ids, picked.logprobs
    assert ids == [0] and math.isclose(lps[0], torch.log_softmax(logits, -1)[0].item())


def test_offline_api_shapes(smollm2):
    llm = LLM.__new__(LLM)  # reuse loaded weights
    from kvwise.config import EngineConfig
    from kvwise.engine.builder import build_engine

    llm.engine = build_engine(
        EngineConfig.from_kwargs(kv_cache_memory="64MiB", kv_host_memory="off", kv_disk_path="off"),
        progress=False,
        loaded=smollm2,
    )
    llm.tokenizer = llm.engine.tokenizer
    params = SamplingParams(max_tokens=5, temperature=0)
    outs = llm.generate(["a", [{"role": "user", "content": "b"}], [1, 2, 3]], params)
    assert [len(o.token_ids) <= 5 for o in outs] == [True] * 3
    assert llm.generate([[5, 6, 7], [8, 9]], params)[1].prompt_token_ids == [8, 9]
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], params)
    streamed = list(llm.stream([{"role": "user", "content": "Hi"}], params))
    assert "".join(s.delta_text for s in streamed) == chat.text == streamed[-1].text
    assert streamed[-1].finished
    m = chat.metrics
    assert m.ttft > 0 and len(m.inter_token_times) == len(chat.token_ids) - 1
    with pytest.raises(ValueError, match="^params:"):
        llm.generate(["a", "b"], [params])
    with pytest.raises(ValueError, match="^prompts:"):
        llm.generate([])


def test_sampler_extreme_values_do_not_crash():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    ids = sample(logits, [SamplingParams(temperature=1e-40)], [0]).token_ids
    assert ids == [0]  # a vanishing temperature is greedy
    big = SamplingParams(temperature=1.0, seed=10**30)
    assert sample(logits, [big], [5]).token_ids == sample(logits, [big], [5]).token_ids
    assert sample(logits, [SamplingParams(temperature=1.0, seed=-7)], [0]).token_ids[0] in range(4)


def test_kv_cache_dtype_is_its_own_setting(make_engine):
    """float32 compute over a bfloat16 KV pool: half the bytes per block, so twice the blocks
    in the same memory, and the same greedy answer at this length (the float32 pool stays the
    reference; quantized KV is measured in its own benchmark)."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    full = make_engine(kv_cache_memory="64MiB")
    half = make_engine(kv_cache_memory="64MiB", kv_cache_dtype="bfloat16")
    assert half.runner.kv_cache.kv.dtype == torch.bfloat16
    assert half.runner.spec.block_bytes * 2 == full.runner.spec.block_bytes
    assert half.kv_manager.num_blocks == 2 * full.kv_manager.num_blocks
    assert half.kv_manager.model_fingerprint != full.kv_manager.model_fingerprint
    outs = [collect(e, prompts, params) for e in (full, half)]
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]

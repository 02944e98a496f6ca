"""Greedy tokens on the real default model: identical to transformers, and identical across
every way the engine can run a request (alone, batched, chunked, preempted, cache off)."""

import pytest
import torch

from kvwise.engine.llm_engine import LLMEngine
from kvwise.types import SamplingParams

NUM_NEW = 64
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)

LONG_TEXT = " ".join(
    f"Section {i}: the committee reviewed item {i * 7} and noted that the budget for "
    f"project {chr(65 + i % 26)} rose by {i % 9} percent compared with last year."
    for i in range(22)
)

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant that answers in one line."},
        {"role": "user", "content": "Explain what a KV cache is."},
    ],
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the mountains,",
    "The following is a list of prime numbers: 2, 3, 5, 7,",
    "Translate to French: 'The weather is nice today.'\nFrench:",
    "Émilie a mangé une crème brûlée à Zürich 🍮 et puis",
    "Q: If I have 3 apples and eat one, how many are left?\nA:",
    LONG_TEXT + "\nSummary of the sections above:",  # over 512 tokens: chunked prefill
    [{"role": "user", "content": "List three uses of Python."}],
]


def hf_greedy(model, prompt_ids: list[int], num_new: int) -> list[int]:
    """Plain greedy decoding with transformers' own KV cache (no EOS stop)."""
    out = []
    with torch.inference_mode():
        res = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(num_new):
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            res = model(
                torch.tensor([[token]]), past_key_values=res.past_key_values, use_cache=True
            )
    return out


def run_outputs(engine: LLMEngine, prompts, params=GREEDY) -> list:
    """Run prompts to the end together; their final ``RequestOutput``s, in order."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def run(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    outputs = run_outputs(engine, prompts, params)
    engine.check_integrity()
    assert engine.kv_manager.pool.num_used_blocks == 0
    return [out.token_ids for out in outputs]


@pytest.fixture(scope="module")
def prompt_ids(make_engine):
    engine = make_engine()
    ids = [engine.tokenize(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > 512
    return ids


@pytest.fixture(scope="module")
def reference(hf_smollm2, prompt_ids):
    return [hf_greedy(hf_smollm2, ids, NUM_NEW) for ids in prompt_ids]


def test_alone_matches_transformers(make_engine, prompt_ids, reference):
    engine = make_engine(enable_prefix_caching=False)
    for ids, expected in zip(prompt_ids, reference, strict=True):
        assert run(engine, [ids]) == [expected]


def test_batched_matches_transformers(make_engine, prompt_ids, reference):
    engine = make_engine(enable_prefix_caching=False)
    assert run(engine, prompt_ids) == reference


def test_batch_of_16_with_chunked_prefill(make_engine, prompt_ids, reference):
    # 16 requests at once; chunk sizes 16, 64 and 512 cut prompts differently
    batch = (prompt_ids * 2)[:16]
    for chunk in (16, 64, 512):
        engine = make_engine(
            enable_prefix_caching=False,
            prefill_chunk_size=chunk,
            max_num_batched_tokens=max(chunk, 64),
        )
        assert run(engine, batch) == (reference * 2)[:16], f"prefill_chunk_size={chunk}"


def test_preemption_and_recompute(make_engine, prompt_ids, reference):
    # a pool too small for all requests at once forces preemption
    engine = make_engine(enable_prefix_caching=False, kv_cache_memory="34MiB", block_size=16)
    assert engine.kv_manager.num_blocks * 16 < sum(len(i) + NUM_NEW for i in prompt_ids)
    assert run(engine, prompt_ids) == reference
    assert engine.scheduler.num_preemptions > 0


def test_preempted_requests_resume_from_the_host_tier(make_engine, prompt_ids, reference):
    """Preemption writes the victim's blocks to the tiers; when it comes back after others
    took its device blocks, it loads them instead of recomputing, and the tokens still match
    transformers. (The prompts twice: with admission waiting for room, the victims of a
    single round come back before anyone took their blocks.)"""
    engine = make_engine(
        kv_cache_memory="34MiB",
        block_size=16,
        kv_host_memory="256MiB",
        kv_store_min_tokens=16,
        kv_load_policy="always",
    )
    assert run(engine, prompt_ids * 2) == reference * 2
    stats = engine.stats()
    assert engine.scheduler.num_preemptions > 0
    assert stats.store.chunks_written > 0 and stats.store.tiers["host"].hits > 0
    engine.close()


def test_cache_disabled_same_tokens_more_projections(make_engine, prompt_ids, reference):
    short = prompt_ids[:3]
    engine = make_engine(enable_kv_cache=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    rid = [engine.add_request(p, params) for p in short]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    for r, ids, expected in zip(rid, short, reference[:3], strict=True):
        out = outs[r]
        assert out.token_ids == expected[:16]
        n = len(ids)
        layers = engine.runner.num_layers
        # without a cache, step i recomputes all n + i tokens of the sequence
        assert out.num_kv_rows_projected == layers * sum(n + i for i in range(16))
    cached = make_engine()
    out = run(cached, short[:1], params)
    assert out[0] == reference[0][:16]

"""Greedy decoding is batch-invariant: the same request gives the same tokens and logprobs (so
bitwise the same logits) alone and inside a batch, on every weight format (the default int4
GGUF, float32, int8) and every KV format.

Inside the batch it decodes in steps shared with other requests' decodes and prefill chunks (a
small token budget and chunk size), its own prompt is cut into other chunks, it is preempted (a
pool too small for the batch) and recomputed, and then its prompt is read from the prefix
cache: none of it may change a bit (issue 25: on the default path it did, through the decode
kernel's split of the keys, which followed the batch size; and float32 matmuls, SDPA prefill).
Without that, "caching never changes the answer" could not be checked under load. The kernels
themselves are checked row by row in tests/unit/test_batch_invariant_kernels.py.
"""

from __future__ import annotations

import os

import pytest

from kvwise import kernels
from kvwise.core.kv_spec import KVSpec, default_block_size
from kvwise.types import SamplingParams

pytestmark = pytest.mark.slow

if not kernels.available():  # the invariance is the kernels': the torch fallback lacks it
    if os.environ.get("CI"):
        pytest.fail("the kvwise kernels did not build in CI", pytrace=False)
    pytest.skip("the kvwise kernels are unavailable here", allow_module_level=True)

KV_FORMATS = ["float32", "bfloat16", "float16", "int8", "int4"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
TARGET = (  # over 32 tokens: a full block in every format, for the prefix cache
    "Here are three facts about the weather, each in one short sentence. Fact 1. Rain falls "
    "from clouds when their droplets grow heavy. Fact 2. Snow is frozen water. Fact"
)
NEIGHBOURS = [
    "Hi",
    "The capital of France is",
    "1 2 3 4 5 6 7",
    "Write a long story about a cat who lives in a lighthouse by the sea, and the storm " * 3,
    "def fib(n):",
    "Once upon a time, " * 12,
    "Why is the sky blue? Explain it to a child.",
    "List the planets of the solar system in order:",
    "Q: What is 17 times 3? A:",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Translate to French: good morning, my friend.",
    "Ingredients for pancakes: flour, eggs,",
    "A haiku about autumn leaves:",
    "In 1969, the first humans",
    "Dear diary, today I learned that " * 4,
]
# a step's budget and a prompt's chunk: prefill chunks share steps with decodes, and the
# target's prompt is cut differently alone than in the batch
SCHEDULE = {"max_num_batched_tokens": 48, "prefill_chunk_size": 16}


@pytest.fixture(scope="module")
def smollm2_int8():
    from kvwise.models.loader import load_model

    return load_model(None, progress=False, quantization="int8")


@pytest.fixture(scope="module")
def weights(smollm2, smollm2_int4, smollm2_int8):
    """The default model loaded for one weight format."""
    return {"auto": smollm2_int4, "none": smollm2, "int8": smollm2_int8}


def _pool_bytes(loaded, kv_dtype: str, num_tokens: int) -> int:
    """kv_cache_memory for a pool of about ``num_tokens`` tokens in ``kv_dtype``."""
    arch, block_size = loaded.arch, default_block_size(kv_dtype)
    spec = KVSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, block_size, kv_dtype)
    return spec.block_bytes * -(-num_tokens // block_size)


def _alone(engine):
    (out,) = _generate(engine, [TARGET])
    return _answer(out)


def _answer(out):
    """Its tokens and their logprobs: equal floats only from bitwise-equal logits."""
    return out.token_ids, out.logprobs


def _generate(engine, prompts):
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def _steps(engine) -> list[dict[str, int]]:
    """Record each step the engine runs: request id -> its number of new tokens."""
    steps: list[dict[str, int]] = []
    execute = engine.runner.execute

    def record(sched_out, *args, **kwargs):
        steps.append({s.request_id: s.num_tokens for s in sched_out.scheduled})
        return execute(sched_out, *args, **kwargs)

    engine.runner.execute = record
    return steps


def _preempted(engine) -> list[str]:
    """Record the ids of the requests the engine's scheduler preempts."""
    victims: list[str] = []
    scheduler = engine.scheduler
    preempt = scheduler._preempt

    def record(request):
        victims.append(request.request_id)
        preempt(request)

    scheduler._preempt = record
    return victims


@pytest.mark.parametrize("quantization", ["auto", "none", "int8"])
@pytest.mark.parametrize("kv_dtype", KV_FORMATS)
def test_a_greedy_request_gives_the_same_tokens_alone_and_in_any_batch(
    make_engine, weights, quantization, kv_dtype
):
    loaded = weights[quantization]
    alone = _alone(
        make_engine(loaded, kv_cache_dtype=kv_dtype, kv_cache_memory="64MiB", **SCHEDULE)
    )
    assert len(alone[0]) == GREEDY.max_tokens

    # the target amid 15 others, in a pool of about a quarter of what they need, admitted on
    # their first chunks: it decodes beside later requests' prefill chunks, and is preempted
    # (the newest running goes first) and recomputed. With ignore_eos the schedule depends
    # only on the block size.
    engine = make_engine(
        loaded, kv_cache_dtype=kv_dtype, kv_cache_memory=_pool_bytes(loaded, kv_dtype, 400),
        admit_whole_prompts=False, **SCHEDULE,
    )  # fmt: skip
    victims, steps = _preempted(engine), _steps(engine)
    batched = _generate(engine, NEIGHBOURS[:8] + [TARGET] + NEIGHBOURS[8:])[8]
    target = batched.request_id
    assert target in victims, "the target was never preempted: resize the pool"
    assert any(step.get(target) == 1 and max(step.values()) > 1 for step in steps), (
        "the target never decoded beside another request's prefill chunk"
    )
    assert _answer(batched) == alone

    # once more, its prompt now in the prefix cache, beside a few others
    outs = _generate(engine, [NEIGHBOURS[3], TARGET, NEIGHBOURS[0]])
    assert outs[1].num_cached_tokens > 0
    assert _answer(outs[1]) == alone

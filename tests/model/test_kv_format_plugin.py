"""A KV format added from this file alone: ``f16x``, float16 K/V under a layout tag of its own.

Its layout facts are registered in the core (``register_kv_format``: 2 bytes a value, no
scales, tag ``f16x``) and its tensors in the worker (``register_kv_cache``: a ``FloatKVCache``
storing float16). Run through the engine on a tiny random model, it must give exactly the
answers of the format it imitates (``float16``: the same tokens and logprobs, cold, from the
prefix cache and loaded back from the host tier), and its tag must keep its stored KV apart
from float16's (the layout is in every block hash and entry header).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from kvwise import LLM, SamplingParams  # noqa: E402
from kvwise.core.kv_spec import (  # noqa: E402
    KVFormat,
    KVSpec,
    kv_formats,
    register_kv_format,
    unregister_kv_format,
)
from kvwise.perf.sizing import KVShape, format_table  # noqa: E402
from kvwise.worker.kv_cache import (  # noqa: E402
    FloatKVCache,
    make_kv_cache,
    register_kv_cache,
    unregister_kv_cache,
)
from tests.model.test_models_tiny import COMMON, _save_random_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % COMMON["vocab_size"] for i in range(70)],
           [(5 * i + 11) % COMMON["vocab_size"] for i in range(41)]]  # fmt: skip
ENGINE = dict(progress=False, kv_cache_memory="8MiB", kv_host_memory="off", kv_disk_path="off")
TIERS = dict(kv_store_min_tokens=16, kv_load_policy="always")  # load whatever a tier holds
HOST = dict(kv_host_memory="16MiB")


class Float16xKVCache(FloatKVCache):
    """The toy format's tensors: float16, as the float16 pool stores them."""

    storage_dtype = torch.float16


@pytest.fixture(scope="module")
def f16x():
    register_kv_format(KVFormat("f16x", 2, uses=("pool", "size"), tag="f16x"))
    register_kv_cache("f16x", Float16xKVCache)
    yield "f16x"
    unregister_kv_cache("f16x")
    unregister_kv_format("f16x")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random HF Llama with a word-level tokenizer over its 128 ids."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    _save_random_model("LlamaConfig", dict(num_key_value_heads=2), directory)
    vocab = {f"t{i}": i for i in range(COMMON["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    return str(directory)


def _answers(outputs) -> list[tuple[list[int], list[float]]]:
    """Tokens and their logprobs: equal floats only from bitwise-equal logits."""
    return [(out.token_ids, out.logprobs) for out in outputs]


def _cold_cached_loaded(llm: LLM):
    """Every prompt cold, then again from the device pool, then loaded from the host tier."""
    cold = llm.generate(PROMPTS, GREEDY)
    cached = llm.generate(PROMPTS, GREEDY)
    assert all(out.num_cached_tokens >= 32 and out.num_loaded_tokens == 0 for out in cached)
    llm.engine.flush()
    llm.engine.kv_manager.pool.reset_prefix_cache()  # what comes back now, comes from the tier
    loaded = llm.generate(PROMPTS, GREEDY)
    assert all(out.num_loaded_tokens >= 32 for out in loaded)
    return _answers(cold), _answers(cached), _answers(loaded)


def test_the_toy_format_is_registered_and_built(f16x):
    assert f16x in kv_formats() and f16x in kv_formats("size") and f16x not in kv_formats("eval")
    spec = KVSpec(2, 2, 16, 16, f16x)
    assert spec.block_bytes == KVSpec(2, 2, 16, 16, "float16").block_bytes
    assert spec.layout.endswith(".f16x") and not spec.quantized
    cache = make_kv_cache(spec, 4, torch.float32)
    assert type(cache) is Float16xKVCache and cache.kv.dtype == torch.float16 and cache.lossy
    # ``kvwise size`` lists it, at float16's bytes (it asks the registry, not a list of its own)
    table = format_table(KVShape(2, 4, 2, 16, "float16"), 1024, 1, None)
    assert [row.split(" | ")[:3] for row in table.splitlines() if "f16x" in row] == [
        ["| f16x", "2 B", "256 B"]
    ]


def test_it_answers_as_float16_cold_cached_and_from_the_host_tier(f16x, tiny_model):
    runs = {}
    for dtype in (f16x, "float16"):
        with LLM(tiny_model, **ENGINE | TIERS | HOST, kv_cache_dtype=dtype) as llm:
            assert llm.engine.runner.spec.dtype == dtype
            runs[dtype] = _cold_cached_loaded(llm)
            assert llm.engine.stats().store.tiers["host"].hits > 0
    cold, cached, loaded = runs[f16x]
    assert cold == cached == loaded
    assert runs[f16x] == runs["float16"]
    assert len(cold[0][0]) == GREEDY.max_tokens


def test_its_stored_kv_is_not_another_formats(f16x, tiny_model, tmp_path):
    """float16 and f16x hold the same bytes, but under other tags: neither reads the other's
    entries (misses, not faults), and each reads its own."""
    disk = ENGINE | TIERS | dict(kv_disk_path=str(tmp_path))
    with LLM(tiny_model, **disk, kv_cache_dtype=f16x) as writer:
        writer.generate(PROMPTS, GREEDY)
    for dtype, expect_loads in (("float16", False), (f16x, True)):
        with LLM(tiny_model, **disk, kv_cache_dtype=dtype) as reader:
            outputs = reader.generate(PROMPTS, GREEDY)
            tier = reader.engine.stats().store.tiers["disk"]
            assert tier.num_entries > 0 and tier.faults == 0
            assert all((out.num_loaded_tokens > 0) == expect_loads for out in outputs), dtype
            assert (tier.hits > 0) == expect_loads


def test_an_unregistered_format_is_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny_model, **ENGINE, kv_cache_dtype="f16y")

"""Sliding-window attention through the engine, against transformers' own.

Mistral- and Qwen2-shaped random models with a window of 48 (every layer windowed), prompts
up to 4x the window: greedy tokens identical to transformers' greedy decoding (its cache keeps
the window's semantics), alone and batched, with prefill chunks smaller than the window, and
the same tokens cold, from the pool's prefix cache, after preemption and from the disk tier,
for float32 and int8 KV (int8: identical among themselves). No context cap at the window any
more; int4 KV, whose kernel has no window, is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvwise import LLM, SamplingParams  # noqa: E402
from kvwise.config import EngineConfig  # noqa: E402
from kvwise.engine.builder import build_engine  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from kvwise.worker.attention import LayerAttention  # noqa: E402
from tests.model.test_engine_vs_hf import hf_greedy, run  # noqa: E402
from tests.model.test_model_family import _write_tokenizer  # noqa: E402
from tests.model.test_models_tiny import _save_random_model  # noqa: E402
from tests.tiers_util import evict_device  # noqa: E402

WINDOW = 48
NUM_NEW = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
CASES = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=0)),
}  # fmt: skip
LENGTHS = [192, 97, 40, 49]  # 4x the window, past it, inside it, just past it


@pytest.fixture(scope="module", params=sorted(CASES))
def model(request, tmp_path_factory):
    config_name, overrides = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = _save_random_model(
        config_name, dict(num_key_value_heads=2, **overrides),
        directory,
    )  # fmt: skip
    _write_tokenizer(directory)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in LENGTHS]
    reference = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    return directory, load_model(directory, progress=False), prompts, reference


def _engine(model, **kwargs):
    kwargs.setdefault("kv_cache_memory", "16MiB")
    kwargs.setdefault("kv_host_memory", "off")
    kwargs.setdefault("kv_disk_path", "off")
    config = EngineConfig.from_kwargs(model=str(model[0]), **kwargs)
    return build_engine(config, progress=False, loaded=model[1])


def test_the_windows_reach_the_attention_and_the_context_is_not_capped(model):
    engine = _engine(model)
    layers = engine.runner.attention.layers
    assert layers is not None and [k.window for k in layers] == [WINDOW, WINDOW]
    assert engine.max_model_len == 256  # the model's context, not its window


def test_greedy_tokens_are_transformers_alone_and_batched(model):
    _, _, prompts, reference = model
    assert run(_engine(model), prompts, GREEDY) == reference
    unwindowed = _engine(model)  # the check can fail: without the window, other tokens
    attention = unwindowed.runner.attention
    attention.layers = [LayerAttention(0, k.scale) for k in attention.layers]
    assert run(unwindowed, prompts, GREEDY)[0] != reference[0]
    for prompt, want in zip(prompts, reference):
        assert run(_engine(model), [prompt], GREEDY) == [want]


def test_prefill_chunks_smaller_than_the_window(model):
    _, _, prompts, reference = model
    engine = _engine(model, prefill_chunk_size=24, max_num_batched_tokens=48)
    assert run(engine, prompts, GREEDY) == reference


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_cold_from_the_pool_after_preemption_and_from_disk(model, kv, tmp_path):
    _, _, prompts, reference = model
    cold = run(_engine(model, kv_cache_dtype=kv, enable_prefix_caching=False), prompts, GREEDY)
    if kv == "float32":
        assert cold == reference
    engine = _engine(model, kv_cache_dtype=kv)
    assert run(engine, prompts, GREEDY) == cold
    again = [engine.add_request(p, GREEDY) for p in prompts]  # the prompts' blocks, cached
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[i].token_ids for i in again] == cold
    assert done[again[0]].num_cached_tokens >= 176
    block_bytes = engine.runner.spec.block_bytes  # a pool of 20 blocks: the four won't fit
    small = _engine(model, kv_cache_dtype=kv, enable_prefix_caching=False,
                    kv_cache_memory=f"{20 * block_bytes}B")  # fmt: skip
    assert run(small, prompts, GREEDY) == cold
    assert small.scheduler.num_preemptions > 0
    disk = _engine(model, kv_cache_dtype=kv, kv_disk_path=str(tmp_path), kv_store_min_tokens=16,
                   kv_load_policy="always")  # fmt: skip
    run(disk, prompts, GREEDY)
    evict_device(disk)
    loaded = [disk.add_request(p, GREEDY) for p in prompts]
    done = {}
    while disk.has_unfinished():
        for out in disk.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[i].token_ids for i in loaded] == cold
    assert done[loaded[0]].num_loaded_tokens >= 176
    disk.close()


def test_int4_kv_is_refused_for_a_windowed_model(model):
    with pytest.raises(ValueError, match="kv_cache_dtype: int4 KV has no sliding-window"):
        _engine(model, kv_cache_dtype="int4")


def test_llm_runs_past_the_window(model):
    with LLM(model=str(model[0]), quantization="none", kv_cache_memory="16MiB",
             kv_host_memory="off", kv_disk_path="off", progress=False) as llm:  # fmt: skip
        out = llm.generate([model[2][0]], GREEDY)[0]
    assert out.token_ids == model[3][0]

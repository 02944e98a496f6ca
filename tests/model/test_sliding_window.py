"""Sliding-window attention through the engine, against transformers' own.

Mistral- and Qwen2-shaped random models with a window of 48 (every layer windowed; and a
Qwen2 with max_window_layers=1, whose window is on its layer 1 alone, as transformers' Qwen2
puts it on layers i >= max_window_layers), prompts up to 4x the window: greedy tokens identical
to transformers' greedy decoding (its cache keeps the window's semantics), alone and batched,
with prefill chunks smaller than the window, and the same tokens cold, from the pool's prefix
cache, after preemption and from the disk tier, for float32, int8 and int4 KV (int8, int4:
identical among themselves; int4's kernel takes the window as the others do: other tokens
without it). No context cap at the window any more. Which layers a config.json windows (Qwen2/3's use_sliding_window
and max_window_layers, an explicit layer_types) is checked against transformers' configs.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvwise import LLM, SamplingParams  # noqa: E402
from kvwise.config import EngineConfig  # noqa: E402
from kvwise.engine.builder import build_engine  # noqa: E402
from kvwise.models import registry  # noqa: E402
from kvwise.models.arch import ModelArchConfig  # noqa: E402
from kvwise.models.arch_load import arch_from_hf_config  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from kvwise.worker.attention import LayerAttention  # noqa: E402
from tests.model.test_engine_vs_hf import hf_greedy, run, run_outputs  # noqa: E402
from tests.model.test_model_family import _write_tokenizer  # noqa: E402
from tests.model.test_models_tiny import _save_random_model  # noqa: E402
from tests.tiers_util import evict_device  # noqa: E402

WINDOW = 48
NUM_NEW = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
# (transformers config, its fields, each layer's window as kvwise's attention gets it); the
# models have 2 layers (test_models_tiny's COMMON)
CASES = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), [WINDOW, WINDOW]),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=0), [WINDOW, WINDOW]),
    "qwen2_upper_layers": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                               max_window_layers=1), [0, WINDOW]),
}  # fmt: skip
LENGTHS = [192, 97, 40, 49]  # 4x the window, past it, inside it, just past it


@pytest.fixture(scope="module", params=sorted(CASES))
def model(request, tmp_path_factory):
    config_name, overrides, windows = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = _save_random_model(
        config_name, dict(num_key_value_heads=2, **overrides),
        directory,
    )  # fmt: skip
    _write_tokenizer(directory)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in LENGTHS]
    reference = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    types = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * 2  # Mistral: all
    assert [WINDOW if t == "sliding_attention" else 0 for t in types] == windows
    return directory, load_model(directory, progress=False), prompts, reference, windows


def _engine(model, **kwargs):
    kwargs.setdefault("kv_cache_memory", "16MiB")
    kwargs.setdefault("block_size", 16)  # int4's too (its default is 32): the same pools
    kwargs.setdefault("kv_host_memory", "off")
    kwargs.setdefault("kv_disk_path", "off")
    config = EngineConfig.from_kwargs(model=str(model[0]), **kwargs)
    return build_engine(config, progress=False, loaded=model[1])


def test_the_windows_reach_the_attention_and_the_context_is_not_capped(model):
    engine = _engine(model)
    layers = engine.runner.attention.layers
    assert layers is not None and [k.window for k in layers] == model[4]
    kinds = model[1].model.attention_kinds  # the model's declaration: None where full
    assert [k.sliding_window or 0 for k in kinds] == model[4]
    assert engine.max_model_len == 256  # the model's context, not its window


def test_greedy_tokens_are_transformers_alone_and_batched(model):
    _, _, prompts, reference, _ = model
    assert run(_engine(model), prompts, GREEDY) == reference
    for windows in ([0, 0], [WINDOW, WINDOW]):  # the check can fail: other windows, other
        if windows == model[4]:  # tokens (none at all; or on every layer, as kvwise once
            continue  # windowed a Qwen2 whatever its max_window_layers)
        other = _engine(model)
        attention = other.runner.attention
        attention.layers = [LayerAttention(w, k.scale) for w, k in zip(windows, attention.layers)]
        assert run(other, prompts, GREEDY) != reference, windows
    for prompt, want in zip(prompts, reference):
        assert run(_engine(model), [prompt], GREEDY) == [want]


def test_prefill_chunks_smaller_than_the_window(model):
    _, _, prompts, reference, _ = model
    engine = _engine(model, prefill_chunk_size=24, max_num_batched_tokens=48)
    assert run(engine, prompts, GREEDY) == reference


@pytest.mark.parametrize("kv", ["float32", "int8", "int4"])
def test_cold_from_the_pool_after_preemption_and_from_disk(model, kv, tmp_path):
    _, _, prompts, reference, _ = model
    cold = run(_engine(model, kv_cache_dtype=kv, enable_prefix_caching=False), prompts, GREEDY)
    if kv == "float32":
        assert cold == reference
    engine = _engine(model, kv_cache_dtype=kv)
    assert run(engine, prompts, GREEDY) == cold
    again = run_outputs(engine, prompts, GREEDY)  # the prompts' blocks, cached
    assert [out.token_ids for out in again] == cold
    assert again[0].num_cached_tokens >= 176
    # a pool just over the longest request's own need, computed 16 tokens a step: the four
    # are admitted on their first chunks, won't fit together, and one is preempted mid-prompt
    manager, chunk = engine.scheduler.kv, 16
    num_pages = max(manager.blocks_for(len(p) + NUM_NEW, chunk) for p in prompts) + 1
    small = _engine(model, kv_cache_dtype=kv, enable_prefix_caching=False,
                    kv_cache_memory=f"{num_pages * engine.runner.spec.block_bytes}B",
                    admit_whole_prompts=False, prefill_chunk_size=chunk)  # fmt: skip
    assert run(small, prompts, GREEDY) == cold
    assert small.scheduler.num_preemptions > 0
    disk = _engine(model, kv_cache_dtype=kv, kv_disk_path=str(tmp_path), kv_store_min_tokens=16,
                   kv_load_policy="always")  # fmt: skip
    run(disk, prompts, GREEDY)
    evict_device(disk)
    loaded = run_outputs(disk, prompts, GREEDY)
    assert [out.token_ids for out in loaded] == cold
    assert loaded[0].num_loaded_tokens >= 176
    disk.close()


def test_int4_kv_attends_within_the_window(model):
    """int4 KV: alone as batched, and other tokens with the windows taken off (the window
    reaches its kernel)."""
    _, _, prompts, _, _ = model
    engine = _engine(model, kv_cache_dtype="int4")
    assert engine.runner.attention.paged_kernel
    batched = run(engine, prompts, GREEDY)
    assert [run(engine, [p], GREEDY)[0] for p in prompts] == batched
    unwindowed = _engine(model, kv_cache_dtype="int4", enable_prefix_caching=False)
    attention = unwindowed.runner.attention
    attention.layers = [LayerAttention(0, k.scale) for k in attention.layers]
    assert run(unwindowed, prompts, GREEDY) != batched


def test_llm_runs_past_the_window(model):
    with LLM(model=str(model[0]), quantization="none", kv_cache_memory="16MiB",
             kv_host_memory="off", kv_disk_path="off", progress=False) as llm:  # fmt: skip
        out = llm.generate([model[2][0]], GREEDY)[0]
    assert out.token_ids == model[3][0]


def _windows(arch: ModelArchConfig) -> list[int | None]:
    """Each layer's window as the family declares it (None: full attention)."""
    return [k.sliding_window for k in registry.family_for(arch.architecture).attention_kinds(arch)]


QWEN2_CONFIG = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=128, hidden_size=64,
    intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, sliding_window=WINDOW,
)  # fmt: skip


@pytest.mark.parametrize(
    "fields",
    [
        dict(use_sliding_window=True, max_window_layers=4),  # layers 4 and 5
        dict(use_sliding_window=True, max_window_layers=0),  # every layer
        dict(use_sliding_window=True, max_window_layers=6),  # none
        dict(use_sliding_window=True),  # max_window_layers absent: 28, so none here
        dict(use_sliding_window=False, max_window_layers=0),  # the window off
        dict(max_window_layers=0),  # use_sliding_window absent: off
        dict(use_sliding_window=True, layer_types=["full_attention", "sliding_attention"] * 3),
        dict(use_sliding_window=False, layer_types=["sliding_attention"] * 6),  # no window
    ],
    ids=["upper", "all", "none", "default_layers", "off", "default_off", "types", "types_off"],
)
def test_a_qwen2_config_windows_the_layers_transformers_windows(fields):
    config = dict(QWEN2_CONFIG, **fields)
    hf = transformers.Qwen2Config(**{k: v for k, v in config.items()
                                     if k not in ("architectures", "model_type")})  # fmt: skip
    want = [WINDOW if t == "sliding_attention" and hf.sliding_window else None
            for t in hf.layer_types]  # fmt: skip
    assert _windows(arch_from_hf_config(config)) == want


def test_an_explicit_layer_types_in_a_mistral_config_is_honoured():
    """Ministral-style alternating layers written into a Mistral config.json: each layer's
    kind as the config names it (transformers' Ministral reads them so)."""
    types = ["sliding_attention", "full_attention"] * 2
    config = dict(QWEN2_CONFIG, architectures=["MistralForCausalLM"], model_type="mistral",
                  num_hidden_layers=4, layer_types=types)  # fmt: skip
    arch = arch_from_hf_config(config)
    assert arch.layer_types == tuple(types) and arch.sliding_window == WINDOW
    assert _windows(arch) == [WINDOW, None] * 2
    everything = arch_from_hf_config(dict(config, layer_types=None))
    assert everything.layer_types == () and everything.sliding_window == WINDOW  # every layer
    with pytest.raises(ValueError, match="^layer_types"):
        arch_from_hf_config(dict(config, layer_types=["chunked_attention"] * 4))

"""The real Gemma 3 270M Q4_K_M GGUF against transformers loading the same file (slow; split
from test_gemma.py, whose tiny random models and configs this file does not need)."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvwise import SamplingParams  # noqa: E402
from kvwise.config import EngineConfig  # noqa: E402
from kvwise.engine.builder import build_engine  # noqa: E402
from kvwise.models.default import gemma3_model_path  # noqa: E402
from kvwise.models.layer_ops import BlockFusedOps  # noqa: E402
from kvwise.models.loader import load_model  # noqa: E402
from tests.model.test_engine_vs_hf import hf_greedy, run, run_outputs  # noqa: E402
from tests.model.test_gemma import _logits  # noqa: E402

GEMMA3_NEW = 32
GEMMA3_GREEDY = SamplingParams(max_tokens=GEMMA3_NEW, temperature=0, ignore_eos=True)
LONG_TEXT = " ".join(
    f"Entry {i}: the museum catalogued piece {i * 13}, a {('bronze', 'marble', 'oak')[i % 3]} "
    f"figure from room {chr(65 + i % 7)}, and moved it to the east wing."
    for i in range(12)
)
GEMMA3_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the mountains,",
    "The following is a list of prime numbers: 2, 3, 5, 7,",
    "Translate to French: 'The weather is nice today.'\nFrench:",
    "Émilie a mangé une crème brûlée à Zürich 🍮 et puis",
    "<start_of_turn>user\nWhat is a KV cache?<end_of_turn>\n<start_of_turn>model\n",
    LONG_TEXT + "\nIn short, the museum",  # a few hundred tokens: chunked prefill
]


@pytest.fixture(scope="module")
def gemma3_path():
    try:
        return gemma3_model_path()
    except ValueError as exc:  # under CI=true this skip fails: install.sh assembles the file
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def gemma3_none(gemma3_path):
    return load_model(gemma3_path, progress=False, quantization="none")


@pytest.fixture(scope="module")
def gemma3_ids(gemma3_none):
    engine = _gemma3_engine(gemma3_none)
    ids = [engine.tokenize(prompt) for prompt in GEMMA3_PROMPTS]
    assert all(prompt[0] == 2 for prompt in ids)  # <bos>
    assert 200 < max(len(prompt) for prompt in ids) < 512 - GEMMA3_NEW  # inside the window
    return ids


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_path):
    """transformers' own load of the same file, float32 (~30 s)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_path.parent), gguf_file=gemma3_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def gemma3_reference(hf_gemma3, gemma3_ids):
    return [hf_greedy(hf_gemma3, ids, GEMMA3_NEW) for ids in gemma3_ids]


def _gemma3_engine(loaded, **kwargs):
    defaults = {"kv_cache_memory": "128MiB", "kv_host_memory": "off", "kv_disk_path": "off"}
    config = EngineConfig.from_kwargs(**{**defaults, **kwargs})
    return build_engine(config, progress=False, loaded=loaded)


@pytest.mark.slow
def test_gemma3_none_is_transformers_alone_and_batched(gemma3_none, gemma3_ids, gemma3_reference):
    arch = gemma3_none.arch
    assert (arch.architecture, arch.num_layers, arch.vocab_size) == (
        "Gemma3ForCausalLM",
        18,
        262144,
    )
    assert arch.layer_types.count("full_attention") == 3 and arch.sliding_window == 512
    engine = _gemma3_engine(gemma3_none, enable_prefix_caching=False)
    assert engine.scheduler.max_model_len == 32768  # not capped at the window
    assert run(engine, gemma3_ids, GEMMA3_GREEDY) == gemma3_reference
    for ids, expected in zip(gemma3_ids, gemma3_reference, strict=True):
        assert run(engine, [ids], GEMMA3_GREEDY) == [expected]


@pytest.mark.slow
def test_gemma3_auto_runs_each_type_as_it_is_and_agrees_with_none(
    gemma3_path, gemma3_none, gemma3_ids, gemma3_reference, caplog
):
    auto = load_model(gemma3_path, progress=False, quantization="auto")
    assert auto.weight_format == "gguf"
    report = {row.gguf_type: row for row in auto.weight_report}
    assert set(report) == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    assert sum(row.tensors for row in report.values()) == 236  # every tensor, the head once
    for gguf_type, row in report.items():
        assert row.runs_as == ("float32" if gguf_type == "F32" else gguf_type) + " (exact)"
    assert auto.model.weight_bytes() < 0.35 * gemma3_none.model.weight_bytes()
    # the file's own types under kvwise's fused float32 ops, Gemma's choices in them
    assert all(isinstance(layer.ops, BlockFusedOps) and layer.quant for layer in auto.model.layers)
    # teacher-forced on "none"'s greedy text: the next token of every generated position
    # (and the plain torch step on the same weights: its float rounding differs, and the
    # int8 rounding of each matmul's input carries that on, so it agrees as closely, no more)
    agree = {"fused": 0, "torch": 0}
    total = 0
    for ids, continuation in zip(gemma3_ids[:4], gemma3_reference[:4], strict=True):
        sequence = torch.tensor(ids + continuation)
        start = len(ids) - 1
        expected = _logits(gemma3_none.model, sequence)[start:].argmax(-1)
        for ops in agree:
            auto.model.use_ops(ops)
            agree[ops] += int((_logits(auto.model, sequence)[start:].argmax(-1) == expected).sum())
        total += len(expected)
    auto.model.use_ops(None)
    for ops, n in agree.items():  # 131/132 measured for each
        assert n / total >= 0.95, f"{ops}: top-1 agreement {n}/{total}"
    with caplog.at_level(logging.INFO, logger="kvwise"):
        engine = _gemma3_engine(auto)
    assert "weights: 81 Q5_0 tensors as Q5_0 (exact)" in caplog.text
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = run(engine, gemma3_ids[:2], params)
    assert [len(t) for t in tokens] == [8, 8]


@pytest.mark.slow
def test_gemma3_none_past_the_window_is_transformers(gemma3_none, hf_gemma3):
    """One prompt of ~1,600 tokens (3x the local layers' window of 512): the local layers
    attend to their last 512 keys, the global ones to all, in one prefill and in chunks."""
    engine = _gemma3_engine(gemma3_none, enable_prefix_caching=False)
    records = " ".join(
        f"Record {i}: shipment {i * 31} of {('apples', 'steel', 'paper', 'glass')[i % 4]} "
        f"left port {chr(65 + i % 9)} on day {i % 28 + 1}."
        for i in range(75)
    )
    ids = engine.tokenize(records + "\nThe last record says shipment")
    assert 1500 < len(ids) < 2000
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = hf_greedy(hf_gemma3, ids, 24)
    assert run(engine, [ids], params) == [expected]
    chunked = _gemma3_engine(gemma3_none, enable_prefix_caching=False, prefill_chunk_size=256,
                             max_num_batched_tokens=256)  # fmt: skip
    assert run(chunked, [ids], params) == [expected]


def _records(first: int) -> str:
    return (
        " ".join(
            f"Record {i}: shipment {i * 31} of {('apples', 'steel', 'paper', 'glass')[i % 4]} "
            f"left port {chr(65 + i % 9)} on day {i % 28 + 1}."
            for i in range(first, first + 75)
        )
        + "\nThe last record says shipment"
    )


def _drain(engine, prompts, params):
    outputs = run_outputs(engine, prompts, params)
    engine.check_integrity()
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["float32", "int8", "int4"])
def test_gemma3_hybrid_cache_cold_pool_preempted_disk_and_all_full(gemma3_path, kv, tmp_path):
    """Two ~1,600-token prompts (3x the window) on the hybrid KV cache: the same greedy tokens
    cold, from the pool (a hit past the window: the local layers' last window only), after
    preemptions in a small pool (admission on the first chunk), loaded from the disk tier,
    and with every layer keeping every token (--no-hybrid-kv-cache)."""
    loaded = load_model(gemma3_path, progress=False)
    kv_args = dict(kv_cache_dtype=kv, block_size=16)  # int4's too (its default is 32)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine = _gemma3_engine(loaded, **kv_args, prefill_chunk_size=256,
                            max_num_batched_tokens=256)  # fmt: skip
    prompts = [engine.tokenize(_records(i)) for i in (0, 40)]
    assert all(1500 < len(p) < 2000 for p in prompts)
    spec = engine.runner.spec
    assert [g.window for g in spec.groups] == [0] + [512] * 5 and spec.num_layers == 3
    cold = [o.token_ids for o in _drain(engine, prompts, params)]
    again = _drain(engine, prompts, params)
    assert [o.token_ids for o in again] == cold
    assert all(o.num_cached_tokens >= len(p) - spec.block_size for o, p in zip(again, prompts))
    small = _gemma3_engine(loaded, **kv_args, prefill_chunk_size=256,
                           max_num_batched_tokens=256, enable_prefix_caching=False,
                           kv_cache_memory=f"{450 * spec.block_bytes}B",
                           admit_whole_prompts=False)  # fmt: skip
    assert [o.token_ids for o in _drain(small, prompts, params)] == cold
    assert small.scheduler.num_preemptions > 0
    full = _gemma3_engine(loaded, **kv_args, hybrid_kv_cache=False)
    assert not full.runner.spec.groups
    assert [o.token_ids for o in _drain(full, prompts, params)] == cold
    disk = _gemma3_engine(loaded, **kv_args, kv_disk_path=str(tmp_path),
                          kv_store_min_tokens=16, kv_load_policy="always")  # fmt: skip
    _drain(disk, prompts, params)
    disk.flush()
    disk.kv_manager.pool.reset_prefix_cache()
    loads = _drain(disk, prompts, params)
    assert [o.token_ids for o in loads] == cold
    assert all(o.num_loaded_tokens >= len(p) - spec.block_size for o, p in zip(loads, prompts))
    disk.close()

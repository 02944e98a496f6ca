"""The device seam (issue 47): the engine built on another torch device touches no CPU-only
path. "meta" tensors have shapes and no data, and kvwise's kernels are registered for the CPU
dispatch key alone, so any kernel call, any CPU tensor mixed into a step or any in-place read
of the pool as host memory fails: a forward pass that returns meta rows of the right shape
shows the model, the pool, the step's tables and the attention all stayed on the device.

The host staging path of the tiers (``reads_in_place`` False, the path a pool off the CPU
takes) is run for real on the CPU: a prompt loaded from the disk tier through host buffers
gives the same tokens as one loaded in place, and ``payload_views`` is never asked."""

from __future__ import annotations

import pytest
import torch

from kvwise.config import EngineConfig
from kvwise.core.kv_spec import KVSpec
from kvwise.engine.builder import build_model_parts
from kvwise.types import SamplingParams
from kvwise.worker.attention import TorchSDPAAttention
from kvwise.worker.input_batch import build_input_batch
from kvwise.worker.kv_cache import make_kv_cache
from tests.tiers_util import evict_device, run

META = torch.device("meta")


def _meta_config(tmp_path, **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(
        device="meta",
        kv_cache_memory="8MiB",
        kv_host_memory="off",
        kv_disk_path="off",
        **kwargs,
    )


@pytest.fixture(scope="module")
def meta_engine(tmp_path_factory):
    config = _meta_config(tmp_path_factory.mktemp("meta"))
    parts = build_model_parts(config, progress=False)
    return parts, parts.assemble(config)


def test_the_engine_builds_on_the_meta_device(meta_engine):
    parts, engine = meta_engine
    runner = parts.runner
    model = runner.model
    assert {t.device for t in model.parameters()} == {META}
    assert {t.device for t in model.buffers()} == {META}
    assert runner.kv_cache.raw.device == META and not runner.kv_cache.use_kernels
    assert type(runner.attention) is TorchSDPAAttention and not runner.attention.paged_kernel
    assert not runner.reads_in_place
    # another device computes other bits: its KV never meets the CPU's in a shared tier
    assert parts.model_fingerprint.endswith("/float32/meta")
    # ... every block hash starts from it
    assert engine.kv_manager.model_fingerprint.startswith(parts.model_fingerprint + "/")


def test_a_step_runs_on_the_meta_device_without_a_cpu_path(meta_engine):
    """Two prompts and, after them, their decodes, scheduled by the real core: every layer's
    attention, the pool's writes and the logits stay on the device, shapes right."""
    parts, engine = meta_engine
    runner = parts.runner
    for i, n in enumerate((37, 5)):
        engine.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=4), request_id=f"r{i}")
    sched = engine.scheduler.schedule()
    assert sum(s.num_tokens for s in sched.scheduled) == 42
    batch = build_input_batch(sched, runner.block_size, runner.num_groups).to(META)
    attn = runner.attention.bind(batch.attn_meta, None, batch.group_metas)
    hidden = runner.model(batch.input_ids, batch.positions, attn)
    assert hidden.device == META and hidden.shape == (42, runner.arch.hidden_size)
    logits = runner.model.compute_logits(hidden[batch.sample_rows])
    assert logits.device == META and logits.shape == (2, runner.vocab_size)
    # a decode step over the same blocks (each request's next token at its own position)
    decodes = [
        type(s)(s.request_id, [1], s.start_pos + s.num_tokens, s.block_ids, True,
                s.sampling_params, 1)
        for s in sched.scheduled
    ]  # fmt: skip
    step = build_input_batch(type(sched)(scheduled=decodes), runner.block_size).to(META)
    out = runner.model(step.input_ids, step.positions, runner.attention.bind(step.attn_meta))
    assert out.shape == (2, runner.arch.hidden_size) and out.device == META


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_pool_of_each_device_format_lies_on_the_device(dtype):
    spec = KVSpec(2, 2, 16, 16, dtype)
    cache = make_kv_cache(spec, 4, torch.float32, device=META)
    assert cache.raw.device == META and cache.rows_attention is None
    with pytest.raises(ValueError, match="payload_views"):
        cache.payload_views([0], 0, 1, (0, 2))


def test_what_runs_on_the_cpu_only_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype: int4 runs on the CPU only"):
        make_kv_cache(KVSpec(2, 2, 32, 32, "int4"), 4, torch.float32, device=META)
    with pytest.raises(ValueError, match="^quantization: 'int4'"):
        EngineConfig.from_kwargs(device="meta", quantization="int4")
    with pytest.raises(ValueError, match="^device: 'cuda:0' is not available"):
        build_model_parts(EngineConfig.from_kwargs(device="cuda:0", kv_cache_memory="8MiB"))
    with pytest.raises(ValueError, match="^device: 'tpu-9' is not a device"):
        build_model_parts(EngineConfig.from_kwargs(device="tpu-9", kv_cache_memory="8MiB"))
    with pytest.raises(ValueError, match="^kv_cache_memory: give the KV pool's size"):
        build_model_parts(EngineConfig.from_kwargs(device="meta", kv_disk_path="off"))


@pytest.mark.parametrize("layer_groups", [1, 5])
def test_tier_loads_through_host_staging_give_the_same_tokens(tier_engine, tmp_path, layer_groups):
    """The path a pool off the CPU takes, run on the CPU: the disk tier (which reads in place
    where it may) reads into host buffers and ``write_kv`` copies them into the blocks, layer
    group by layer group; ``payload_views`` is never asked."""
    answers = []
    for in_place in (True, False):
        engine = tier_engine(
            kv_disk_path=str(tmp_path / str(in_place)), kv_layer_groups=layer_groups
        )
        runner = engine.runner
        runner.reads_in_place = in_place
        asked, views = [], runner.payload_views
        runner.payload_views = lambda *a, views=views, asked=asked: asked.append(1) or views(*a)
        first = run(engine)
        evict_device(engine)
        again = run(engine)
        assert again.num_loaded_tokens == (again.num_prompt_tokens - 1) // 16 * 16 > 0
        assert bool(asked) == in_place
        answers += [first.token_ids, again.token_ids]
    assert all(a == answers[0] for a in answers)

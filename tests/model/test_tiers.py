"""The host and disk tiers on the default model: greedy tokens identical after a round trip,
after a restart, across tenants (isolated), through faults, and for parked sessions."""

from __future__ import annotations

import pytest

from kvwise.store import serde
from tests.tiers_util import PROMPT, evict_device, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(make_engine):
    engine = make_engine()
    out = run(engine)
    assert out.num_prompt_tokens > 300
    return out.token_ids


@pytest.fixture
def tiered(tier_engine):
    return tier_engine


@pytest.mark.parametrize("tier,layer_groups", [("host", 1), ("disk", 1), ("host", 5), ("disk", 30)])
def test_round_trip_is_token_identical(tiered, tmp_path, reference, tier, layer_groups):
    """Loaded whole, or streamed by layer groups while the step runs (host entries are copied
    in; disk entries are read straight into the device blocks)."""
    kw = {"kv_host_memory": "256MiB"} if tier == "host" else {"kv_disk_path": str(tmp_path)}
    engine = tiered(kv_layer_groups=layer_groups, **kw)
    first = run(engine)
    assert first.token_ids == reference and first.num_loaded_tokens == 0
    evict_device(engine)
    again = run(engine)
    full_blocks = (again.num_prompt_tokens - 1) // 16
    assert again.num_loaded_tokens == full_blocks * 16
    assert again.num_cached_tokens == again.num_loaded_tokens
    assert again.token_ids == reference
    stats = engine.stats()
    assert stats.store.tiers[tier].hits > 0 and stats.store.tiers[tier].faults == 0
    assert stats.store.load_decisions == 1


def test_disk_tier_survives_a_restart(tiered, tmp_path, reference):
    engine = tiered(kv_disk_path=str(tmp_path))
    run(engine)
    engine.close()  # flushes
    restarted = tiered(kv_disk_path=str(tmp_path))
    assert restarted.stats().store.tiers["disk"].num_entries > 0
    out = run(restarted)
    assert out.num_loaded_tokens > 0 and out.token_ids == reference


def test_tiers_are_isolated_by_tenant_and_salt(tiered, tmp_path, reference):
    engine = tiered(kv_host_memory="256MiB", kv_disk_path=str(tmp_path))
    run(engine, tenant="alice")
    evict_device(engine)
    for kw in ({"tenant": "bob"}, {"tenant": "alice", "cache_salt": "s"}):
        out = run(engine, **kw)
        assert out.num_cached_tokens == 0 and out.token_ids == reference, kw
    # a fresh engine on the same disk (host tier empty): nothing for a third tenant
    # (bob's own run above stored bob's blocks, which are bob's to reuse)
    engine.close()  # one engine per disk directory
    other = tiered(kv_host_memory="off", kv_disk_path=str(tmp_path))
    assert run(other, tenant="carol").num_cached_tokens == 0
    assert run(other, tenant="alice").num_loaded_tokens > 0


def test_an_entry_evicted_from_host_after_the_plan_loads_from_disk(tiered, tmp_path, reference):
    """The host tier evicts the planned entries (LRU, for the writer's puts) between the plan
    and the read: the disk tier, written through, still holds them, so the load lands and
    nothing is rolled back (issue 45 item 6: 11 rollbacks in a fault-free load run)."""
    engine = tiered(kv_host_memory="256MiB", kv_disk_path=str(tmp_path))
    run(engine)
    evict_device(engine)
    host, schedule = engine.store.tiers[0], engine.scheduler.schedule

    def schedule_then_host_evicts():
        out = schedule()
        if out.kv_loads:
            assert {t for load in out.kv_loads for t in load.chunk.tiers} == {"host"}
            host.delete(host.eviction_order())
        return out

    engine.scheduler.schedule = schedule_then_host_evicts
    out = run(engine)
    assert out.token_ids == reference
    assert out.num_loaded_tokens == (out.num_prompt_tokens - 1) // 16 * 16
    assert engine.scheduler.num_load_rollbacks == 0
    tiers = engine.stats().store.tiers
    assert tiers["host"].misses > 0 and tiers["disk"].hits > 0
    assert tiers["host"].faults == tiers["disk"].faults == 0


def test_prefix_continues_from_device_hit_into_tiers(tiered, tmp_path, reference):
    """The device holds the head of the prompt; the tiers supply the rest (mid-chunk)."""
    engine = tiered(kv_host_memory="256MiB")
    run(engine)
    engine.flush()
    pool = engine.kv_manager.pool
    # keep the first 3 blocks on the device, drop the rest
    by_id = sorted(pool.cached.values(), key=lambda b: b.block_id)
    assert len(by_id) > 3
    pool.drop_cached([b.block_hash for b in by_id[3:]])
    assert len(pool.cached) == 3
    out = run(engine)
    assert out.num_cached_tokens == (out.num_prompt_tokens - 1) // 16 * 16
    assert out.num_loaded_tokens == out.num_cached_tokens - 3 * 16
    assert out.token_ids == reference


@pytest.mark.parametrize(
    "damage,layer_groups", [("flip", 1), ("truncate", 1), ("foreign", 1), ("flip", 3)]
)
def test_damaged_disk_entries_are_misses(tiered, tmp_path, reference, damage, layer_groups):
    """The damage is found after the bytes landed in the device blocks (and, with layer
    groups, possibly after the model already ran on earlier groups): the request is rolled
    back to what was verified and the rest recomputed."""
    engine = tiered(kv_disk_path=str(tmp_path), kv_layer_groups=layer_groups)
    run(engine)
    evict_device(engine)
    fmt = engine.store.fmt
    first_blocks = {  # every entry file -> its first block (the header is in the clear)
        path: serde.unpack(fmt, bytes.fromhex(path.stem), path.read_bytes()).first_block
        for path in sorted(tmp_path.rglob("*.kv"))
    }
    second = sorted(set(first_blocks.values()))[1]  # the prompt's second entry
    victim = next(path for path, first in first_blocks.items() if first == second)
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 3]
    else:  # a well-formed entry from another model
        data[40:56] = bytes(16)  # the model digest field
    victim.write_bytes(bytes(data))
    out = run(engine)
    assert out.token_ids == reference
    stats = engine.stats()
    assert stats.store.tiers["disk"].faults >= 1
    assert engine.scheduler.num_load_rollbacks == 1
    # the fault stops loading at that chunk; what precedes it is still used
    assert out.num_loaded_tokens < (out.num_prompt_tokens - 1) // 16 * 16
    assert out.num_cached_tokens == out.num_loaded_tokens


def test_full_disk_budget_evicts_and_keeps_serving(tiered, tmp_path, reference):
    # each entry is 8 blocks of 720 KiB (≈ 5.6 MiB): a 12 MiB budget holds two
    engine = tiered(kv_disk_path=str(tmp_path), kv_disk_size="12MiB")
    run(engine)
    engine.flush()
    stats = engine.stats()
    assert stats.store.tiers["disk"].evictions >= 1
    assert stats.store.tiers["disk"].num_bytes <= 12 * 2**20
    assert sum(f.stat().st_size for f in tmp_path.rglob("*.kv")) <= 12 * 2**20
    evict_device(engine)
    out = run(engine)
    assert out.token_ids == reference  # the first chunk was evicted: nothing loads, all good


def test_disk_full_is_a_fault_not_an_error(tiered, tmp_path, reference, monkeypatch):
    import errno

    from kvwise.store import disk

    engine = tiered(kv_disk_path=str(tmp_path))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "replace", no_space)
    out = run(engine)
    engine.flush()
    assert out.token_ids == reference
    assert engine.stats().store.tiers["disk"].faults >= 1
    assert not list(tmp_path.rglob("*.kv")) and not list(tmp_path.rglob("*.tmp"))
    monkeypatch.undo()
    evict_device(engine)
    assert run(engine).token_ids == reference


def test_parked_session_resumes_from_a_tier(tiered, tmp_path, make_engine):
    turn1 = [{"role": "user", "content": PROMPT}]
    ref_engine = make_engine()
    ref1 = run(ref_engine, turn1)
    turn2 = turn1 + [
        {"role": "assistant", "content": ref1.text},
        {"role": "user", "content": "And which fruit is yellow?"},
    ]
    ref2 = run(ref_engine, turn2)

    engine = tiered(kv_disk_path=str(tmp_path))
    out1 = run(engine, turn1, session_id="conv-1")
    assert out1.token_ids == ref1.token_ids
    parked = engine.park("conv-1")
    assert parked >= (out1.num_prompt_tokens // 16 - 1) * 16
    pool = engine.kv_manager.pool
    assert pool.num_cached_free_blocks < 3  # the conversation left the device pool
    out2 = run(engine, turn2, session_id="conv-1")
    assert out2.token_ids == ref2.token_ids
    assert out2.num_loaded_tokens >= parked - 16
    with pytest.raises(ValueError, match="session_id"):
        engine.park("never-seen")
    with pytest.raises(ValueError, match="session_id"):
        engine.park("conv-1", tenant="someone-else")


def test_cost_model_recomputes_when_loading_is_slower(tiered, tmp_path, reference):
    engine = tiered(kv_disk_path=str(tmp_path))
    run(engine)
    evict_device(engine)
    # pretend the disk reads at 1 MB/s: recomputing ~330 tokens is far cheaper
    engine.store.cost.tier_fit("disk").w = [0.0, 0.0, 1000.0]
    out = run(engine)
    assert out.num_loaded_tokens == 0 and out.token_ids == reference
    decision = engine.store.decisions[-1]
    assert decision.available_tokens > 0 and decision.chosen_tokens == 0
    assert engine.stats().store.recompute_decisions == 1


def test_retained_prefix_is_kept_on_disk(tiered, tmp_path):
    import time

    engine = tiered(kv_disk_path=str(tmp_path))
    run(engine, retention="24h")
    engine.flush()
    mtimes = [f.stat().st_mtime for f in tmp_path.rglob("*.kv")]
    assert mtimes and min(mtimes) > time.time() + 23 * 3600


EXIT_WITHOUT_CLOSE = """
import sys, time
from kvwise import LLM, SamplingParams
from kvwise.store import disk
from tests.tiers_util import PROMPT

put = disk.DiskStore.put
def slow_put(self, *args, **kwargs):  # still queued when the interpreter starts to exit
    time.sleep(1.0)
    return put(self, *args, **kwargs)
disk.DiskStore.put = slow_put
llm = LLM(kv_cache_memory="256MiB", kv_host_memory="off", kv_disk_path=sys.argv[1],
          kv_store_min_tokens=16, progress=False)
if sys.argv[2] == "with":
    with llm:
        llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))
    assert llm.engine.store.stats().pending_write_bytes == 0
else:
    llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))
"""


@pytest.mark.parametrize("how", ["exit", "with"])
def test_pending_writes_are_flushed_at_exit(tmp_path, how):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path), how],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list(tmp_path.rglob("*.kv"))) >= 2


def test_stored_entries_do_not_reveal_layer0_values(tiered, tmp_path):
    """The decoding attack of issue 10: match stored bytes against the prompt's layer-0 V rows
    (each token's value vector, which maps back to its vocabulary entry). Sealed entries hold
    no row within 1e-3 of one, at any byte alignment; the opened payloads (control) do."""
    import torch

    engine = tiered(
        kv_disk_path=str(tmp_path), kv_store_secret="a secret of thirty-two characters or more"
    )
    run(engine)
    engine.flush()
    kv = engine.runner.kv_cache.kv  # (layers, 2, blocks, block_size, kv_heads, head_dim)
    head_dim = kv.shape[-1]
    ids = sorted(b.block_id for b in engine.kv_manager.pool.cached.values())[:2]
    targets = kv[0, 1, ids].reshape(-1, head_dim).float()
    assert targets.abs().max() > 0.01  # real values, not an empty pool

    def nearest(data: bytes, offset: int) -> float:
        """Distance (max abs) from any target row to the nearest row starting at ``offset``
        (mod the row size) in ``data``, read as float32."""
        rows = (len(data) - offset) // (4 * head_dim)
        found = torch.frombuffer(bytearray(data[offset : offset + rows * 4 * head_dim]),
                                 dtype=torch.float32).view(rows, head_dim)  # fmt: skip
        found = torch.nan_to_num(found, nan=1e9, posinf=1e9, neginf=-1e9)
        return torch.cdist(targets, found, p=float("inf")).min().item()

    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    for path in files:
        data = path.read_bytes()
        fmt = engine.store.fmt
        payload_at = fmt.head_bytes(serde.entry_blocks_from_size(fmt, 0, len(data)))
        for align in range(4):
            assert nearest(data, payload_at + align) > 1e-3, (path.name, align)
    control = serde.unpack(engine.store.fmt, bytes.fromhex(files[0].stem), files[0].read_bytes())
    assert nearest(bytes(control.payload), 0) < 1e-6  # the search finds plaintext rows

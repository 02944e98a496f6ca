"""KV events (core/kv_events.py) from the block pool, their msgpack batches in vLLM's shape
(cluster/kv_events_codec.py) and the cache-aware choice of replica (cluster/routing.py)."""

from __future__ import annotations

import random

import pytest

from kvwise.cluster.routing import CacheAwarePolicy, Load, PrefixIndex
from kvwise.core.hashing import BlockHasher
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from kvwise.core.request import Request
from kvwise.types import RequestOptions, SamplingParams

BS = 4


def _request(rid: str, tokens: list[int], tenant: str = "default") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), options=RequestOptions(tenant=tenant))


def _compute(manager: KVCacheManager, request: Request) -> list[bytes]:
    """Allocate and 'compute' the whole prompt; return its full blocks' hashes."""
    computed, num_cached = manager.get_computed_blocks(request)
    manager.allocate_slots(request, request.num_tokens - num_cached, computed)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return list(request.block_hashes[: request.num_tokens // BS])


def test_the_pool_reports_blocks_stored_and_evicted():
    manager = KVCacheManager(num_blocks=6, block_size=BS, model_fingerprint="m", kv_events=True)
    a = _request("a", list(range(10)))  # two full blocks and a partial one
    hashes = _compute(manager, a)
    events = manager.take_kv_events()
    assert events == [BlockStored(hashes, None, BS, "device")]  # the partial block: not yet
    assert manager.take_kv_events() == []
    manager.free(a)
    b = _request("b", list(range(100, 124)))  # six blocks: evicts a's cached blocks
    _compute(manager, b)
    events = manager.take_kv_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)
    off = KVCacheManager(num_blocks=6, block_size=BS, model_fingerprint="m")
    _compute(off, _request("c", list(range(10))))
    assert off.take_kv_events() == []


def test_the_log_is_bounded_and_merges_removals():
    log = KVEventLog(block_size=BS, max_events=2)
    log.removed([b"a"])
    log.removed([b"b"])  # merged into one event
    log.stored([b"c"], None)
    log.stored([b"d"], b"c")  # the oldest is dropped
    assert log.dropped == 1
    assert log.drain() == [BlockStored([b"c"], None, BS), BlockStored([b"d"], b"c", BS)]


def test_batches_round_trip_in_vllms_shape():
    msgpack = pytest.importorskip("msgpack")
    from kvwise.cluster.kv_events_codec import decode_batch, encode_batch

    events = [BlockStored([b"\x01" * 32, b"\x02" * 32], None, 16), BlockRemoved([b"\x03" * 32]),
              AllBlocksCleared()]  # fmt: skip
    data = encode_batch(events, ts=12.5)
    raw = msgpack.unpackb(data)
    assert raw[0] == 12.5
    assert raw[1][0] == ["BlockStored", [b"\x01" * 32, b"\x02" * 32], None, [], 16, None, "device"]
    assert raw[1][1] == ["BlockRemoved", [b"\x03" * 32], "device"] and raw[1][2] == [
        "AllBlocksCleared"
    ]
    assert decode_batch(data) == (12.5, events)
    vllm_style = msgpack.packb([1.0, [["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None]]])
    assert decode_batch(vllm_style)[1] == [BlockStored([7, 8], 6, 2, "device")]
    with pytest.raises(ValueError, match="^kv_events:"):
        decode_batch(msgpack.packb([1.0, [["Nope"]]]))


def _chains(tokens: list[int], tenant: str = "default") -> list[bytes]:
    """A router's chain for a prompt: the engine's own hasher, outside any engine."""
    return BlockHasher("m", BS).chain(tokens, tenant)


def test_a_routers_chain_is_the_engines_public_prefixes_included():
    public = list(range(1000, 1016))  # four blocks, shared in chunks of 8 tokens
    manager = KVCacheManager(num_blocks=64, block_size=BS, model_fingerprint="m",
                             public_prefixes=[public], public_min_tokens=8)  # fmt: skip
    hasher = BlockHasher("m", BS, [public], public_min_tokens=8)
    for tenant, tokens in (("t1", public + [1, 2, 3, 4, 5]), ("t2", public[:13] + [9] * 7),
                           ("t1", list(range(30)))):  # fmt: skip
        engine_chain = _compute(manager, _request(f"{tenant}-{len(tokens)}", tokens, tenant))
        assert hasher.chain(tokens, tenant) == engine_chain
    shared = hasher.chain(public + [1, 2, 3, 4], "t1")
    other = hasher.chain(public + [1, 2, 3, 4], "t2")
    assert shared[:4] == other[:4] and shared[4] != other[4]  # the public part only


def test_routing_follows_the_prefix_and_never_another_tenants():
    index = PrefixIndex()
    conversation = list(range(40))
    held = _chains(conversation)
    index.apply("r1", [BlockStored(held, None, BS)])
    index.apply("r2", [BlockStored(_chains(list(range(500, 540))), None, BS)])
    policy = CacheAwarePolicy(index, BS, rng=random.Random(0))
    loads = {"r1": Load(), "r2": Load()}
    next_turn = _chains(conversation + list(range(900, 912)))
    choice = policy.choose(next_turn, 52, loads)
    assert (choice.replica, choice.overlap_blocks, choice.reason) == ("r1", 10, "cache")
    # the same tokens from another tenant hash apart: nobody holds them, power of two
    other = _chains(conversation + list(range(900, 912)), tenant="acme")
    assert not set(other) & set(held)
    assert policy.choose(other, 52, loads).reason == "power-of-two"
    assert policy.choose(other, 52, loads).overlap_blocks == 0


def test_load_outweighs_a_short_overlap_and_imbalance_falls_back():
    index = PrefixIndex()
    chain = _chains(list(range(40)))
    index.apply("r1", [BlockStored(chain[:2], None, BS)])  # 8 of 40 tokens cached
    policy = CacheAwarePolicy(index, BS, imbalance_tokens=1000, rng=random.Random(0))
    busy = {"r1": Load(queued_tokens=500), "r2": Load()}
    assert policy.choose(chain, 40, busy).replica == "r2"  # 32 + 500 vs 40 tokens
    # running sequences weigh a tenth of queued prompts by default (all of them, here)
    decoding = {"r1": Load(running_tokens=50), "r2": Load()}
    assert policy.choose(chain, 40, decoding).replica == "r1"  # 32 + 5 vs 40
    strict = CacheAwarePolicy(index, BS, running_weight=1.0, rng=random.Random(0))
    assert strict.choose(chain, 40, decoding).replica == "r2"  # 32 + 50 vs 40
    # weighted 4x, prefill outweighs r1's load, but r1 is 1,500 tokens busier than r2: the
    # imbalance cap sends the request by the power of two instead
    long_chain = _chains(list(range(400)))
    index.apply("r1", [BlockStored(long_chain, None, BS)])
    policy = CacheAwarePolicy(index, BS, overlap_weight=4, imbalance_tokens=1000,
                              rng=random.Random(0))  # fmt: skip
    loads = {"r1": Load(queued_tokens=1500), "r2": Load()}
    choice = policy.choose(long_chain, 400, loads)
    assert (choice.replica, choice.reason) == ("r2", "balance")
    relaxed = CacheAwarePolicy(index, BS, overlap_weight=4, imbalance_tokens=2000)
    assert relaxed.choose(long_chain, 400, loads).replica == "r1"  # 1,500 < 1,600


def test_a_tie_goes_to_the_replica_holding_more_of_the_prompt():
    """The next turn of a conversation: "b" holds all of its previous turn, "a" only the
    shared system prompt; the turn just routed to "b" still counts there, which makes the
    costs equal. The tie goes to "b" (by name it would go to "a")."""
    index = PrefixIndex()
    chain = _chains(list(range(40)))  # 10 blocks
    index.apply("a", [BlockStored(chain[:6], None, BS)])
    index.apply("b", [BlockStored(chain[:10], None, BS)])
    policy = CacheAwarePolicy(index, BS, rng=random.Random(0))
    loads = {"a": Load(), "b": Load(queued_tokens=16)}  # 44 - 24 + 0 vs 44 - 40 + 16
    choice = policy.choose(_chains(list(range(44))), 44, loads)
    assert (choice.replica, choice.reason) == ("b", "cache")


@pytest.mark.parametrize(("kwargs", "field"), [({"block_size": 0}, "block_size"),
                                                ({"overlap_weight": -1}, "overlap_weight"),
                                                ({"imbalance_tokens": -1}, "imbalance_tokens"),
                                                ({"running_weight": 2}, "running_weight")])  # fmt: skip
def test_bad_policy_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        CacheAwarePolicy(PrefixIndex(), **{"block_size": BS, **kwargs})
    with pytest.raises(ValueError, match="^loads:"):
        CacheAwarePolicy(PrefixIndex(), BS).choose([], 1, {})


def test_an_engine_hands_out_its_pools_events_when_asked():
    from kvwise.types import RequestOptions as Options
    from tests.fakes import fake_engine, run_all

    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine = fake_engine(enable_kv_events=True)
    run_all(engine, ["abcdefgh" * 4], greedy, Options(tenant="t1"))
    stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == (32 + 4 - 1) // BS  # full blocks computed (not the last token)
    assert stored[0].parent_block_hash is None and all(len(h) == 32 for h in hashes)
    assert engine.take_kv_events() == []
    quiet = fake_engine()
    run_all(quiet, ["abcdefgh" * 4], greedy)
    assert quiet.take_kv_events() == []


def test_an_engines_events_include_its_host_tier_by_chunk():
    from tests.fakes import fake_engine, run_all

    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine = fake_engine(enable_kv_events=True, kv_host_memory="1MiB", kv_store_min_tokens=4)
    run_all(engine, ["abcdefgh" * 8], greedy)
    engine.store.flush()
    events = engine.take_kv_events()
    device = {h for e in events if isinstance(e, BlockStored) and e.medium == "device"
              for h in e.block_hashes}  # fmt: skip
    host = [e for e in events if e.medium == "host"]
    assert host and all(isinstance(e, BlockStored) for e in host)
    assert {h for e in host for h in e.block_hashes} <= device  # the pool's blocks, written down
    # a router keeps each medium apart: the device index is not fooled by the host's copies
    index = PrefixIndex()
    index.apply("r1", events)
    assert index.num_blocks("r1") == len(device)
    quiet = fake_engine(kv_host_memory="1MiB", kv_store_min_tokens=4)
    run_all(quiet, ["abcdefgh" * 8], greedy)
    quiet.store.flush()
    assert quiet.take_kv_events() == [] and quiet.store.take_tier_events() == []


def test_the_router_stays_in_step_and_recovers_from_a_gap_with_a_snapshot():
    pytest.importorskip("msgpack")
    from kvwise.cluster.event_sync import EventPublisher, IndexSync

    manager = KVCacheManager(num_blocks=8, block_size=BS, model_fingerprint="m", kv_events=True)
    publisher = EventPublisher(manager.take_kv_events, manager.cached_hashes, ring=2)
    sync = IndexSync(PrefixIndex())
    assert publisher.since(0) == [] and publisher.poll() is None
    first = _compute(manager, _request("a", list(range(12))))  # 3 blocks cached
    publisher.poll()
    assert sync.apply("r1", publisher.since(0)) is True  # a new replica starts at batch 1
    assert sync.index.overlap("r1", first) == 3 and sync.cursor["r1"] == 1
    manager.free(_request("a", [1]))
    for i in range(3):  # three more batches: the ring (2) loses the first of them
        _compute(manager, _request(f"b{i}", list(range(100 * (i + 1), 100 * (i + 1) + 8))))
        publisher.poll()
    assert publisher.since(sync.cursor["r1"]) is None  # a gap: batch 2 is gone
    assert sync.apply("r1", [(4, b"")]) is False and sync.gaps == 1  # out of order: refused
    seq, held = publisher.snapshot()
    sync.apply_snapshot("r1", seq, held)
    assert sync.index.num_blocks("r1") == len(manager.cached_hashes()) and seq == 4
    assert sync.apply("r1", publisher.since(seq)) is True
    # a replica that restarted (its numbers start again) is caught by the same check
    fresh = EventPublisher(lambda: [], lambda: [])
    assert fresh.since(seq) is None
    sync.drop("r1")
    assert sync.index.num_blocks("r1") == 0 and "r1" not in sync.cursor


def test_an_engine_reports_its_load_in_tokens():
    from tests.fakes import fake_engine

    engine = fake_engine(max_num_batched_tokens=16)
    assert engine.load_tokens() == (0, 0)
    engine.add_request("a" * 40, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("b" * 10, SamplingParams(max_tokens=8, ignore_eos=True))
    queued, running = engine.load_tokens()
    assert queued == 50 and running == 0  # byte tokenizer: a token a byte
    engine.step()  # 16 tokens of the first prompt computed
    queued, running = engine.load_tokens()
    assert queued == 50 - 16 and running == 40
    while engine.has_unfinished():
        engine.step()
    # a waiting prompt counts only past the prefix its pool holds ("a" * 40: 5 blocks of 8)
    engine.add_request("a" * 40 + "c" * 8, SamplingParams(max_tokens=1))
    assert engine.load_tokens() == (48 - 40, 0)
    assert engine.stats().kv.prefix_query_tokens == 50  # the estimate is not a lookup


def test_replicas_and_a_router_meet_at_the_hub():
    pytest.importorskip("msgpack")
    from kvwise.cluster.event_sync import EventHub, EventPublisher, IndexSync, sync_from_hub

    managers = {r: KVCacheManager(num_blocks=8, block_size=BS, model_fingerprint="m",
                                  kv_events=True) for r in ("r1", "r2")}  # fmt: skip
    pubs = {r: EventPublisher(m.take_kv_events, m.cached_hashes) for r, m in managers.items()}
    hub = EventHub(ring=2)
    sync = IndexSync(PrefixIndex())

    def step(replica: str, tokens: list[int], rid: str) -> list[bytes]:
        chain = _compute(managers[replica], _request(rid, tokens))
        batch = pubs[replica].poll()
        if hub.publish(replica, [batch] if batch else [], (len(tokens), 0)):
            hub.publish_snapshot(replica, *pubs[replica].snapshot())
        return chain

    a = step("r1", list(range(12)), "a")
    step("r2", list(range(50, 58)), "b")
    loads = sync_from_hub(sync, hub.pull(sync.cursor))
    assert loads == {"r1": (12, 0), "r2": (8, 0)}
    assert sync.index.overlap("r1", a) == 3 and sync.index.overlap("r2", a) == 0
    for i in range(3):  # r1 runs ahead of the router: the hub's ring (2) drops a batch
        managers["r1"].free(_request("a" if i == 0 else f"c{i - 1}", [1]))
        step("r1", list(range(100 * (i + 1), 100 * (i + 1) + 8)), f"c{i}")
    sync_from_hub(sync, hub.pull(sync.cursor))
    assert sync.need_snapshot == {"r1"}  # a gap
    hub.want_snapshot("r1")
    step("r1", list(range(900, 904)), "d")  # its next publish answers with a snapshot
    sync_from_hub(sync, hub.pull(sync.cursor))
    assert sync.need_snapshot == set()
    assert sync.index.num_blocks("r1") == len(managers["r1"].cached_hashes())
    hub.drop("r2")
    assert "r2" not in hub.pull({})


def test_work_sent_to_a_replica_counts_until_the_replica_acknowledges_it():
    pytest.importorskip("msgpack")
    from kvwise.cluster.event_sync import EventHub
    from kvwise.cluster.routing import RecentWork

    hub, recent = EventHub(), RecentWork(expiry_s=0.5)
    hub.publish("r1", [], (0, 0))
    recent.add("r1", "turn-1", now=10.0, tokens=155)
    recent.add("r1", "turn-2", now=10.0, tokens=40)
    assert recent.tokens("r1", now=10.1) == 195
    # r1 admits turn-1 and publishes a load that counts it: the router stops counting it
    hub.publish("r1", [], (155, 0), acked=["turn-1"])
    reply = hub.pull({}, recent.pending())
    assert reply["r1"]["acked"] == ["turn-1"]
    recent.acknowledged("r1", reply["r1"]["acked"])
    assert recent.tokens("r1", now=10.1) == 40
    recent.completed("r1", "turn-2")
    assert recent.tokens("r1", now=10.1) == 0 and recent.pending() == {}
    recent.add("r1", "lost", now=10.0, tokens=7)  # never acknowledged: gone after expiry_s
    assert recent.tokens("r1", now=10.4) == 7 and recent.tokens("r1", now=10.6) == 0
    assert hub.pull({}, {"r1": ["never-sent"]})["r1"]["acked"] == []
    hub.drop("r1")
    assert hub.pull({}, {"r1": ["turn-1"]}) == {}

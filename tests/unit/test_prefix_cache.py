"""Prefix caching bookkeeping: hash chain isolation, eviction order, retention, tenant cap,
public prefixes. Exact block ids throughout."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwise.core.hashing import hash_block, root_hash
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.request import Request
from kvwise.types import RequestOptions, SamplingParams

P = SamplingParams(max_tokens=1, temperature=0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def computed(manager, rid, tokens, tenant="default", salt=None, retention=None):
    """Run a request's prompt through the manager as if fully computed; return its blocks."""
    options = RequestOptions(tenant=tenant, cache_salt=salt, retention=retention)
    req = Request(rid, tokens, P, options=options)
    blocks, num_cached = manager.get_computed_blocks(req)
    req.num_computed_tokens = 0
    ids = manager.allocate_slots(req, len(tokens) - num_cached, blocks)[0]
    req.num_computed_tokens = len(tokens)
    manager.cache_full_blocks(req)
    return req, ids, num_cached


# ---- hash chain --------------------------------------------------------------------------


def test_roots_differ_by_model_tenant_and_salt():
    roots = {
        root_hash("m1", "a"),
        root_hash("m2", "a"),
        root_hash("m1", "b"),
        root_hash("m1", "a", "s"),
        root_hash("m1", "a", ""),
        root_hash("m1", "ab"),
    }
    assert len(roots) == 6


def test_length_prefixing_prevents_concatenation_collisions():
    # "ab" + "c" vs "a" + "bc" as (model, tenant) would collide under plain concatenation
    assert root_hash("ab", "c") != root_hash("a", "bc")
    parent = root_hash("m", "t")
    assert hash_block(parent, [1, 2]) != hash_block(parent, [12])
    assert hash_block(parent, [1, 2]) != hash_block(parent, [2, 1])


@settings(max_examples=200, deadline=None)
@given(
    a=st.tuples(
        st.sampled_from(["m1", "m2"]),
        st.text(min_size=1, max_size=4),
        st.one_of(st.none(), st.text(max_size=3)),
    ),
    b=st.tuples(
        st.sampled_from(["m1", "m2"]),
        st.text(min_size=1, max_size=4),
        st.one_of(st.none(), st.text(max_size=3)),
    ),
    tokens=st.lists(st.integers(0, 50), min_size=4, max_size=12),
)
def test_no_collisions_across_models_tenants_salts(a, b, tokens):
    chain = []
    for model, tenant, salt in (a, b):
        parent = root_hash(model, tenant, salt)
        hashes = []
        for i in range(0, len(tokens) // 4 * 4, 4):
            parent = hash_block(parent, tokens[i : i + 4])
            hashes.append(parent)
        chain.append(hashes)
    assert (chain[0] == chain[1]) == (a == b)


# ---- hits within and across tenants -------------------------------------------------------


def test_hit_only_within_same_tenant_and_salt():
    m = KVCacheManager(32, 4, model_fingerprint="m")
    tokens = list(range(10))
    _, first_ids, cached = computed(m, "a1", tokens, tenant="alice")
    assert (first_ids, cached) == ([0, 1, 2], 0)
    _, ids, cached = computed(m, "b1", tokens, tenant="bob")
    assert cached == 0 and ids == [3, 4, 5]
    _, ids, cached = computed(m, "a2", tokens, tenant="alice")
    assert cached == 8 and ids[:2] == [0, 1]  # every full block of the prompt
    _, ids, cached = computed(m, "a3", tokens, tenant="alice", salt="s")
    assert cached == 0
    m.check_integrity()


def test_freed_blocks_are_revived_and_evicted_lru_tail_first():
    m = KVCacheManager(6, 2, model_fingerprint="m")
    req, ids, _ = computed(m, "a", [1, 2, 3, 4, 5, 6])
    assert ids == [0, 1, 2]
    m.free(req)
    # tail first: the sequence's last block is evicted first
    assert m.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    # a new request takes the never-used blocks, then the tail of "a" (in id order)
    req_b, ids_b, _ = computed(m, "b", [9, 9, 9, 9, 9, 9, 9, 9])
    assert ids_b == [2, 3, 4, 5]
    m.free(req_b)
    assert m.pool.free_queue.block_ids() == [1, 0, 5, 4, 3, 2]
    # "a"'s first two blocks survive and are revived; its third is recomputed, in the block
    # at the queue's head
    _, ids, cached = computed(m, "a2", [1, 2, 3, 4, 5, 6])
    assert cached == 4 and ids == [0, 1, 5]
    m.check_integrity()


# ---- retention and the tenant cap -----------------------------------------------------------


def test_kept_blocks_evicted_after_all_others_and_on_expiry():
    clock = Clock()
    m = KVCacheManager(6, 2, model_fingerprint="m", clock=clock)
    kept, _, _ = computed(m, "kept", [1, 2, 3, 4], retention=3600)  # blocks 0, 1
    plain, _, _ = computed(m, "plain", [5, 6, 7, 8])  # blocks 2, 3
    m.free(kept)
    m.free(plain)
    assert m.pool.retained_queue.block_ids() == [1, 0]
    assert m.pool.free_queue.block_ids() == [4, 5, 3, 2]
    # four new blocks come from the main queue; the kept ones are untouched
    computed(m, "x", [9] * 8)
    assert m.pool.get_cached_block(kept.block_hashes[0]) is not None
    assert m.pool.get_cached_block(plain.block_hashes[0]) is None
    # once the pool is otherwise full, kept blocks go too (oldest-freed first)
    computed(m, "y", [8] * 2)
    assert m.pool.get_cached_block(kept.block_hashes[1]) is None
    assert m.pool.get_cached_block(kept.block_hashes[0]) is not None
    m.check_integrity()


def test_expired_retention_returns_blocks_to_lru_head():
    clock = Clock()
    m = KVCacheManager(4, 2, model_fingerprint="m", clock=clock)
    kept, _, _ = computed(m, "kept", [1, 2, 3, 4], retention=60)
    m.free(kept)
    assert m.pool.retained_queue.block_ids() == [1, 0]
    clock.now += 61
    assert m.pool.expire_retention() == 2
    assert m.pool.free_queue.block_ids() == [1, 0, 2, 3]
    assert m.pool.num_retained == {}
    m.check_integrity()


def test_per_tenant_cap_on_kept_blocks():
    m = KVCacheManager(
        16, 2, model_fingerprint="m", max_retained_blocks_per_tenant=3, clock=Clock()
    )
    a, _, _ = computed(m, "a", list(range(10)), tenant="alice", retention=3600)  # 5 blocks
    assert m.pool.num_retained == {"alice": 3}
    computed(m, "b", list(range(50, 54)), tenant="bob", retention=3600)
    assert m.pool.num_retained == {"alice": 3, "bob": 2}
    m.free(a)
    assert m.pool.retained_queue.num_free_blocks == 3
    m.check_integrity()


def test_hit_extends_retention():
    clock = Clock()
    m = KVCacheManager(8, 2, model_fingerprint="m", clock=clock)
    a, _, _ = computed(m, "a", [1, 2, 3, 4, 5], retention=60)
    m.free(a)
    clock.now += 50
    b, _, cached = computed(m, "b", [1, 2, 3, 4, 5], retention=60)
    assert cached == 4
    m.free(b)
    clock.now += 50  # 100 s after the first request, 50 after the second
    m.pool.expire_retention()
    assert m.pool.retained_queue.num_free_blocks == 2
    m.check_integrity()


# ---- public prefixes --------------------------------------------------------------------------


def test_public_prefix_shared_across_tenants_in_whole_chunks():
    system = list(range(100, 120))  # 20 tokens
    m = KVCacheManager(64, 4, model_fingerprint="m", public_prefixes=[system], public_min_tokens=8)
    _, ids_a, cached = computed(m, "a", system + [1, 2, 3, 4, 5], tenant="alice")
    assert cached == 0
    # bob shares the public part, rounded down to whole 8-token chunks: 16 tokens
    _, ids_b, cached = computed(m, "b", system + [1, 2, 3, 4, 5], tenant="bob")
    assert cached == 16 and ids_b[:4] == ids_a[:4] and ids_b[4] != ids_a[4]
    # alice gets her own blocks past the public part as well
    _, ids_a2, cached = computed(m, "a2", system + [1, 2, 3, 4, 5], tenant="alice")
    assert cached == 24 and ids_a2[:6] == ids_a[:6]
    # a prompt matching less than one chunk shares nothing
    _, _, cached = computed(m, "c", system[:7] + [0] * 9, tenant="carol")
    assert cached == 0
    m.check_integrity()


def test_public_prefix_partial_match_never_leaks_tenant_blocks():
    system = list(range(100, 116))  # 16 tokens, two chunks of 8
    m = KVCacheManager(64, 4, model_fingerprint="m", public_prefixes=[system], public_min_tokens=8)
    # alice's prompt diverges from the public prefix after 12 tokens
    secret = system[:12] + [7, 7, 7, 7, 7, 7, 7, 7, 1]
    computed(m, "a", secret, tenant="alice")
    _, _, cached = computed(m, "b", secret, tenant="bob")
    assert cached == 8  # only the first whole public chunk

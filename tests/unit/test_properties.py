"""Hypothesis: pool and manager invariants hold after every operation of random workloads."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwise.config import SchedulerConfig
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.request import Request
from kvwise.core.scheduler import Scheduler
from kvwise.types import FinishReason, RequestOptions, SamplingParams
from kvwise.worker.fake_runner import FakeModelRunner

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0)),
    st.tuples(st.just("tick"), st.integers(1, 100), st.just(0), st.just(0)),
    st.tuples(st.just("drop"), st.integers(0, 7), st.just(0), st.just(0)),  # park: drop cached
)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(op, min_size=1, max_size=40),
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    caching=st.booleans(),
    chunk=st.sampled_from([None, 3, 16]),
)
def test_invariants_after_every_operation(ops, num_blocks, block_size, caching, chunk):
    clock = Clock()
    manager = KVCacheManager(
        num_blocks,
        block_size,
        enable_caching=caching,
        clock=clock,
        max_retained_blocks_per_tenant=num_blocks // 3,
    )
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=chunk)
    scheduler = Scheduler(config, manager, max_model_len=400)
    runner = FakeModelRunner(num_blocks, block_size)
    next_id = 0
    for kind, a, b, prefix in ops:
        if kind == "add":
            # a few shared prefixes so that blocks get shared by reference count
            tokens = [prefix] * (a // 2) + list(range(a - a // 2))
            try:
                scheduler.add_request(
                    Request(
                        str(next_id),
                        tokens,
                        SamplingParams(max_tokens=b, temperature=0),
                        options=RequestOptions(
                            tenant=f"t{prefix % 2}", retention=[None, 30.0][a % 2]
                        ),
                    )
                )
            except ValueError:
                assert len(tokens) >= num_blocks * block_size
            next_id += 1
        elif kind == "step":
            for _ in range(a):
                out = scheduler.schedule()
                scheduler.update(out, runner.execute(out))
        elif kind == "tick":
            clock.now += a
        elif kind == "drop":
            hashes = list(manager.pool.cached)[a::3]
            free_before = manager.pool.num_free_blocks
            manager.pool.drop_cached(hashes)
            assert manager.pool.num_free_blocks == free_before  # only free blocks are dropped
            assert all(
                manager.pool.cached.get(h) is None or manager.pool.cached[h].ref_cnt for h in hashes
            )
        else:
            scheduler.finish_requests([str(a)], FinishReason.ABORT)
        manager.check_integrity()
        pool = manager.pool
        assert pool.num_free_blocks + pool.num_used_blocks == num_blocks
        live = set(manager.req_to_blocks)
        assert live <= {r.request_id for r in scheduler.running}
    # drain: everything finishes and every block comes back
    for _ in range(2000):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out))
    assert scheduler.num_unfinished == 0
    assert manager.pool.num_free_blocks == num_blocks
    manager.check_integrity()

"""The session map ``park`` reads: bounded in bytes, in total and per tenant, and no tenant
can push out another's sessions."""

import pytest

from kvwise.engine.sessions import SessionMap, session_bytes

H = [bytes(32)] * 4  # a turn of four full blocks


def test_a_flooding_tenant_evicts_only_its_own_sessions():
    size = session_bytes("alice", "conv-0", H)
    sessions = SessionMap(max_bytes=100 * size)
    for i in range(10):
        sessions.record("alice", f"conv-{i}", H)
    for i in range(10_000):  # 4 MB keys in the issue; many sessions here
        sessions.record("mallory", f"flood-{i:06d}", H)
    assert all(sessions.last_turn("alice", f"conv-{i}") == H for i in range(10))
    assert sessions.num_bytes <= sessions.max_bytes
    assert sessions.last_turn("mallory", "flood-009999") == H  # its newest stay
    assert sessions.last_turn("mallory", "flood-000000") is None
    assert sessions.num_evicted > 0


def test_per_tenant_cap_and_lru_within_a_tenant():
    size = session_bytes("t", "s0", H)
    sessions = SessionMap(max_bytes=1000 * size, max_bytes_per_tenant=3 * size)
    for i in range(3):
        sessions.record("t", f"s{i}", H)
    assert sessions.last_turn("t", "s0") == H  # s0 is now the most recently used
    sessions.record("t", "s3", H)
    assert sessions.last_turn("t", "s1") is None  # the least recently used went
    assert [sessions.last_turn("t", f"s{i}") for i in (0, 2, 3)] == [H, H, H]
    assert sessions.tenant_bytes("t") == 3 * size
    assert sessions.last_turn("u", "s0") is None  # tenants never see each other's


def test_bytes_follow_replacement_and_an_oversized_turn_is_not_kept():
    sessions = SessionMap(max_bytes=10_000)
    sessions.record("t", "s", H)
    sessions.record("t", "s", H * 2)
    assert sessions.num_bytes == session_bytes("t", "s", H * 2) and len(sessions) == 1
    sessions.record("t", "s", [bytes(32)] * 1000)  # 32 kB: more than the map holds
    assert sessions.last_turn("t", "s") is None and sessions.num_bytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        SessionMap(max_bytes=0)

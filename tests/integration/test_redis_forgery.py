"""Entries planted in a shared Redis by someone without the store secret never load (on the
fake runner, against a real redis-server): the forgery is a counted fault, the answer does
not change, and keys do not reveal which prompts were sent."""

from kvwise.store import serde
from kvwise.types import SamplingParams
from tests.fakes import fake_engine, run_all
from tests.tiers_util import evict_device
from tests.unit.test_store_sealing import _forge

P = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = "Bob's diagnosis stays between Bob and his doctor, whatever the cache holds. " * 2


def _engine(url: str, secret: str):
    return fake_engine(
        kv_redis_url=url, kv_store_secret=secret, kv_store_min_tokens=8, kv_chunk_blocks=4,
        kv_load_policy="always",
    )  # fmt: skip


def test_a_forged_redis_entry_is_rejected_counted_and_the_answer_is_unchanged(redis_db):
    reference = run_all(fake_engine(), [LONG], P)[0]
    engine = _engine(redis_db.url, "the deployment's secret, long enough")
    run_all(engine, [LONG], P)
    evict_device(engine)
    client = redis_db.client()
    keys = client.keys("kvwise:kv:*")
    assert len(keys) > 2
    public = serde.EntryFormat(engine.store.fmt.spec, "x").seal_key  # the secret-less key
    for key in keys:
        client.set(key, _forge(engine.store.fmt, client.get(key), public))
    out = run_all(engine, [LONG], P)[0]
    assert out.token_ids == reference.token_ids and out.num_loaded_tokens == 0
    redis = engine.stats().store.tiers["redis"]
    assert redis.faults >= 1 and redis.hits == 0
    client.close()
    engine.close()


def test_installations_with_different_secrets_share_nothing(redis_db):
    first = _engine(redis_db.url, "the first installation secret, long enough")
    run_all(first, [LONG], P)
    first.flush()
    client = redis_db.client()
    keys_one = set(client.keys("kvwise:kv:*"))
    second = _engine(redis_db.url, "the second installation secret, long enough")
    out = run_all(second, [LONG], P)[0]
    assert out.num_loaded_tokens == 0  # cannot even find the first one's entries
    second.flush()
    keys_two = set(client.keys("kvwise:kv:*")) - keys_one
    assert keys_two and len(keys_two) == len(keys_one)  # same prompt, other key names
    client.close()
    first.close()
    second.close()

"""Entry keys are HMACs under a store secret: nobody without it can compute the key of a
given prompt's entry (to probe for it, or to plant one). The secret comes from the config (or
$KVWISE_KV_SECRET); a disk tier alone makes its own; a shared Redis needs one."""

import logging
import os
import stat

import pytest

from kvwise.config import StoreConfig
from kvwise.core.kv_spec import KVSpec
from kvwise.store import serde
from kvwise.store.factory import build_store, check_secret_strength

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4)
BLOCK = bytes(range(32))  # a chain hash


@pytest.fixture(autouse=True)
def no_secret_in_the_environment(monkeypatch):
    monkeypatch.delenv("KVWISE_KV_SECRET", raising=False)


def store(**config):
    config = {"kv_host_memory": "off", "kv_disk_path": "off", **config}
    return build_store(StoreConfig(**config), SPEC, "model", None)


def test_keys_differ_between_installations_and_from_the_plain_hash():
    a = store(kv_host_memory="1MiB", kv_store_secret="first installation secret, long enough")
    b = store(kv_host_memory="1MiB", kv_store_secret="second installation secret, long enough")
    again = store(kv_host_memory="1MiB", kv_store_secret="first installation secret, long enough")
    key_a = a.fmt.entry_key(BLOCK, 0)
    assert key_a != b.fmt.entry_key(BLOCK, 0)
    assert key_a != serde.entry_key(BLOCK, 0)  # not what anyone can compute from the prompt
    assert key_a == again.fmt.entry_key(BLOCK, 0)  # engines sharing the secret agree
    for s in (a, b, again):
        s.close()


def test_a_disk_tier_alone_makes_its_own_secret_and_keeps_it(tmp_path):
    first = store(kv_disk_path=str(tmp_path / "one"))
    key = first.fmt.entry_key(BLOCK, 0)
    first.close()
    secret_file = tmp_path / "one" / ".kvwise.secret"
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    restarted = store(kv_disk_path=str(tmp_path / "one"))
    assert restarted.fmt.entry_key(BLOCK, 0) == key  # its entries stay findable
    other = store(kv_disk_path=str(tmp_path / "two"))
    assert other.fmt.entry_key(BLOCK, 0) != key
    restarted.close()
    other.close()


def test_host_ram_alone_gets_a_fresh_secret():
    a, b = store(kv_host_memory="1MiB"), store(kv_host_memory="1MiB")
    assert a.fmt.secret and a.fmt.entry_key(BLOCK, 0) != b.fmt.entry_key(BLOCK, 0)


def test_a_shared_redis_without_a_secret_is_refused(caplog):
    url = "redis://127.0.0.1:1/0"  # never reached: the store is refused first
    with pytest.raises(ValueError, match="^kv_store_secret: a shared Redis tier needs"):
        store(kv_redis_url=url)
    with caplog.at_level(logging.WARNING, logger="kvwise"):
        allowed = store(kv_redis_url=url, kv_redis_allow_no_secret=True)
    assert allowed.fmt.secret == b"" and "predictable" in caplog.text
    allowed.close()


def test_the_secret_from_the_environment_and_never_echoed(monkeypatch):
    monkeypatch.setenv("KVWISE_KV_SECRET", "a secret from the environment, long enough")
    from_env = store(kv_redis_url="redis://127.0.0.1:1/0")
    explicit = store(
        kv_redis_url="redis://127.0.0.1:1/0",
        kv_store_secret="a secret from the environment, long enough",
    )
    assert from_env.fmt.entry_key(BLOCK, 0) == explicit.fmt.entry_key(BLOCK, 0)
    assert "a secret" not in repr(
        StoreConfig(kv_store_secret="a secret from the environment, long enough")
    )
    with pytest.raises(ValueError, match="^kv_store_secret: too weak") as info:
        StoreConfig(kv_store_secret="short")
    assert "short" not in str(info.value)
    from_env.close()
    explicit.close()


WEAK = [
    "a" * 64,  # one character
    "short secret",
    "sixteen chars!!!",
    "thirty-one characters, not 32!!",
    "0123456789abcdef0123456789abcdef",  # `openssl rand -hex 16`: 16 bytes
    "0123456789abcdef" * 3 + "0123456789abcde",  # 63 hex digits
    "abcabcabcabcabcabcabcabcabcabcabcabc",  # 36 characters, 3 different
]
STRONG = [
    "0123456789abcdef" * 4,  # 64 hex digits: 32 bytes
    "Zk3vQ9m0Xb7LrT2pWc5nYh8sJd4fGa1e",  # 32 characters that are not all hex
    "correct horse battery staple, and a fifth word",
]


@pytest.mark.parametrize("secret", WEAK)
def test_a_weak_secret_is_refused_naming_the_option_and_never_echoed(secret, monkeypatch):
    with pytest.raises(ValueError, match="^kv_store_secret: too weak") as info:
        store(kv_host_memory="1MiB", kv_store_secret=secret)
    assert secret not in str(info.value) and "kvwise secret" in str(info.value)
    with pytest.raises(ValueError, match="^kv_store_secret: too weak"):
        StoreConfig(kv_store_secret=secret)  # the config's own check is the same rule
    monkeypatch.setenv("KVWISE_KV_SECRET", secret)
    with pytest.raises(ValueError, match=r"^kv_store_secret \(\$KVWISE_KV_SECRET\): too weak"):
        store(kv_host_memory="1MiB")


@pytest.mark.parametrize("secret", STRONG)
def test_a_strong_secret_is_taken(secret):
    store(kv_host_memory="1MiB", kv_store_secret=secret).close()


def test_kvwise_secret_prints_one_that_passes(capsys):
    from kvwise.cli import main

    assert main(["secret"]) == 0
    printed = capsys.readouterr().out.strip()
    assert len(printed) == 64 and int(printed, 16) >= 0
    check_secret_strength(printed)
    main(["secret"])
    assert capsys.readouterr().out.strip() != printed


def test_a_disk_tier_path_it_cannot_use_is_a_value_error_naming_it(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="^kv_disk_path: .* is not a directory"):
        store(kv_disk_path=str(a_file))
    with pytest.raises(ValueError, match="^kv_disk_path: cannot create .* is not a directory"):
        store(kv_disk_path=str(a_file / "under"))
    (tmp_path / "tier" / ".kvwise.secret").mkdir(parents=True)
    with pytest.raises(ValueError, match="^kv_disk_path: the disk tier's store secret .* not a"):
        store(kv_disk_path=str(tmp_path / "tier"))

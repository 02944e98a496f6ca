"""Sealed entries: nobody without the store secret can read stored KV or plant KV that loads
(on the fake runner, whose KV slots hold each token's id + 1, so plaintext KV shows the
prompt as plainly as a real model's layer-0 V rows do)."""

import os
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvwise.core.kv_spec import KVSpec
from kvwise.store import serde
from kvwise.types import SamplingParams
from tests.fakes import ByteTokenizer, fake_engine, run_all
from tests.tiers_util import evict_device

P = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SECRET = "the secret of this installation, long enough"
LONG = "Alice's account number is 4417 1234 5678 9113; her pet is a cat. " * 2  # 134 bytes
FMT = serde.EntryFormat(KVSpec(2, 1, 1, 4, "float32"), "model", secret=b"s" * 32)


def _entry() -> bytes:
    payload = bytes(range(2 * FMT.group_block_bytes(0)))
    return serde.pack(FMT, [b"a" * 32, b"b" * 32], 0, 0, payload)


def test_an_entry_opens_only_under_its_own_key_and_secret():
    value = _entry()
    key = FMT.entry_key(b"b" * 32, 0)  # the key of its last block
    entry = serde.unpack(FMT, key, value)
    assert bytes(entry.payload) == bytes(range(2 * FMT.group_block_bytes(0)))
    assert entry.block_hashes == [b"a" * 32, b"b" * 32]
    other = serde.EntryFormat(FMT.spec, "model", secret=b"t" * 32)
    with pytest.raises(serde.CorruptEntry, match="authentication failed"):
        serde.unpack(other, key, value)  # another installation's secret
    for moved in (b"a" * 32, b"c" * 32):  # its first block's key, or any other
        with pytest.raises(serde.CorruptEntry, match="another key"):
            serde.unpack(FMT, FMT.entry_key(moved, 0), value)
    with pytest.raises(serde.CorruptEntry, match="another key"):
        serde.unpack(FMT, FMT.entry_key(b"b" * 32, 1), value)  # another layer group's key
    assert _entry() != value  # a fresh nonce each time: equal KV, unequal bytes


def test_no_byte_of_the_sealed_part_can_change():
    value = _entry()
    key = FMT.entry_key(b"b" * 32, 0)
    assert serde.unpack(FMT, key, value).block_hashes == [b"a" * 32, b"b" * 32]  # the control
    for i in range(serde.HEADER_SIZE - 12, len(value)):  # the nonce, the sealed part, the tag
        damaged = bytearray(value)
        damaged[i] ^= 0x01
        with pytest.raises(serde.CorruptEntry):
            serde.unpack(FMT, key, bytes(damaged))


def _forge(fmt: serde.EntryFormat, value: bytes, key_guess: bytes) -> bytes:
    """What an attacker with write access and the format (but not the secret) can build: the
    victim's header (readable) with a fresh nonce, the victim's block hashes (computable from
    public inputs) and all-zero KV, sealed under a key of the attacker's choosing."""
    entry = serde.unpack(fmt, bytes(value[8:40]), value)  # the test's view, not the attacker's
    nonce = os.urandom(12)
    header = value[: serde.HEADER_SIZE - 12] + nonce
    sealed = AESGCM(key_guess).encrypt(
        nonce, b"".join(entry.block_hashes) + bytes(entry.payload.nbytes), header
    )
    forged = header + sealed
    assert len(forged) == len(value)
    return forged


def test_a_forged_disk_entry_is_rejected_counted_and_the_answer_is_unchanged(tmp_path):
    reference = run_all(fake_engine(), [LONG], P)[0]
    engine = fake_engine(
        kv_disk_path=str(tmp_path), kv_store_secret=SECRET, kv_store_min_tokens=8,
        kv_chunk_blocks=4, kv_load_policy="always",
    )  # fmt: skip
    run_all(engine, [LONG], P)
    evict_device(engine)
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) > 2
    public = serde.EntryFormat(engine.store.fmt.spec, "x").seal_key  # the secret-less key
    for path in files:
        path.write_bytes(_forge(engine.store.fmt, path.read_bytes(), public))
    out = run_all(engine, [LONG], P)[0]
    assert out.token_ids == reference.token_ids
    assert out.num_loaded_tokens == 0
    disk = engine.stats().store.tiers["disk"]
    assert disk.faults >= 1 and disk.hits == 0  # a forgery is a fault, never a hit
    evict_device(engine)  # the forgeries were deleted and written again from the recomputed KV
    again = run_all(engine, [LONG], P)[0]
    assert again.token_ids == reference.token_ids
    assert again.num_loaded_tokens == (len(LONG) - 1) // 4 * 4
    engine.close()


def test_an_entry_moved_to_another_key_is_rejected(tmp_path):
    engine = fake_engine(
        kv_disk_path=str(tmp_path), kv_store_secret=SECRET, kv_store_min_tokens=8,
        kv_chunk_blocks=4, kv_load_policy="always",
    )  # fmt: skip
    reference = run_all(engine, [LONG], P)[0]
    evict_device(engine)
    files = sorted(tmp_path.rglob("*.kv"), key=lambda p: p.stat().st_size)
    # every entry replaced by another one of the same size (a replay under a foreign key)
    same_size = [f for f in files if f.stat().st_size == files[-1].stat().st_size]
    assert len(same_size) > 2
    contents = [f.read_bytes() for f in same_size]
    for path, data in zip(same_size, contents[1:] + contents[:1]):
        path.write_bytes(data)
    out = run_all(engine, [LONG], P)[0]
    assert out.token_ids == reference.token_ids and out.num_loaded_tokens == 0
    assert engine.stats().store.tiers["disk"].faults >= 1
    engine.close()


def _runs(values: list[int], fmt: str) -> list[bytes]:
    """Every run of 6 consecutive values packed as ``fmt`` (little-endian)."""
    return [struct.pack(f"<6{fmt}", *values[i : i + 6]) for i in range(len(values) - 5)]


def test_stored_bytes_reveal_neither_the_prompt_nor_its_kv(tmp_path):
    """The decoding attack: with read access, look for the prompt's token ids (as bytes, int32
    or int64) or its KV values (the fake runner's slots: id + 1 as float32) in every stored
    byte. Control: the same search finds them in the opened payloads."""
    engine = fake_engine(
        kv_disk_path=str(tmp_path), kv_store_secret=SECRET, kv_store_min_tokens=8,
        kv_chunk_blocks=4,
    )  # fmt: skip
    run_all(engine, [LONG], P)
    engine.flush()
    ids = ByteTokenizer().encode(LONG)
    needles = _runs(ids, "B") + _runs(ids, "i") + _runs(ids, "q")
    needles += _runs([float(i + 1) for i in ids], "f")
    stored = b"".join(p.read_bytes() for p in sorted(tmp_path.rglob("*.kv")))
    assert len(stored) > 1000
    assert not [n for n in needles if n in stored]
    opened = b"".join(
        bytes(serde.unpack(engine.store.fmt, bytes.fromhex(p.stem), p.read_bytes()).payload)
        for p in sorted(tmp_path.rglob("*.kv"))
    )
    assert sum(n in opened for n in _runs([float(i + 1) for i in ids], "f")) > 20
    engine.close()


@pytest.mark.parametrize("num_blocks", [1, 3, 40])  # 40: a payload past the scratch slice
def test_an_entry_read_in_place_opens_where_it_lies_with_the_installed_cryptography(num_blocks):
    """``open_parts`` decrypts each part where it was read (the disk tier's ``preadv`` into
    the device pool): with whatever ``cryptography`` release is installed (51 refuses
    overlapping buffers), across the scratch slice's boundary, into parts of odd sizes."""
    fmt = serde.EntryFormat(KVSpec(2, 4, 64, 16, "float32"), "model", secret=b"s" * 32)
    block_bytes = fmt.group_block_bytes(0)  # 16 KiB: 40 blocks are 640 KiB
    hashes = [bytes([i]) * 32 for i in range(num_blocks)]
    payload = os.urandom(num_blocks * block_bytes)
    value = serde.pack(fmt, hashes, 5, 0, payload)
    key = fmt.entry_key(hashes[-1], 0)
    head_end = fmt.head_bytes(num_blocks)
    cuts = sorted({head_end, head_end + 7, head_end + block_bytes, len(value) - serde.TAG_SIZE})
    parts = [bytearray(value[a:b]) for a, b in zip([0, *cuts], [*cuts, len(value)])]
    entry = serde.open_parts(fmt, key, parts)
    assert (entry.first_block, entry.block_hashes, entry.payload) == (5, hashes, None)
    assert b"".join(parts[1:-1]) == payload  # the plaintext, where the ciphertext was
    assert bytes(parts[0][serde.HEADER_SIZE :]) == b"".join(hashes)
    damaged = [bytearray(value[a:b]) for a, b in zip([0, *cuts], [*cuts, len(value)])]
    damaged[-2][-1] ^= 1
    with pytest.raises(serde.CorruptEntry, match="authentication failed"):
        serde.open_parts(fmt, key, damaged)

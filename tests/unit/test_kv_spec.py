"""KVSpec is the one owner of the KV layout: every byte count the cache, the tiers and the
sizing report use comes from it."""

import pytest

from kvwise.core.kv_spec import KVSpec
from kvwise.perf.sizing import KVShape
from kvwise.store import serde

SMOLLM2 = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)


def test_default_model_bytes():
    assert SMOLLM2.bytes_per_token == 46_080  # 2 x 30 x 3 x 64 x 4 B
    assert SMOLLM2.half_block_bytes == 16 * 3 * 64 * 4
    assert SMOLLM2.layer_block_bytes == 2 * SMOLLM2.half_block_bytes
    assert SMOLLM2.block_bytes == 30 * SMOLLM2.layer_block_bytes == 737_280
    assert SMOLLM2.cache_shape(10) == (30, 2, 10, 16, 3, 64)
    assert SMOLLM2.num_blocks_in(737_280 * 5 + 1) == 5
    assert SMOLLM2.layout == "L30.KV3.D64.B16.float32"


def test_dtype_and_side_data_change_bytes_and_layout():
    half = KVSpec(30, 3, 64, 16, "bfloat16")
    assert half.block_bytes * 2 == SMOLLM2.block_bytes
    int8 = KVSpec(30, 3, 64, 16, "int8")  # + a float32 scale per token and head
    assert int8.layer_block_bytes == 2 * (16 * 3 * 64 + 16 * 3 * 4)
    assert int8.side_bytes == 2 * 16 * 3 * 4
    # int4, 32-token blocks: keys a float16 scale + min per head and channel; values per
    # token in groups of 32 channels: both halves 3,840 B
    int4 = KVSpec(30, 3, 64, 32, "int4")
    assert int4.group_size == 32 and int4.sealed_keys
    assert int4.key_scale_bytes == int4.value_scale_bytes == 3 * 64 * 4
    assert int4.half_block_bytes == 32 * 3 * 32 + 3 * 64 * 4 == 3840
    # 16-token blocks: the values' scales are the shorter half, padded to the keys'
    int4_16 = KVSpec(30, 3, 64, 16, "int4")
    assert int4_16.value_scale_bytes == 16 * 3 * 2 * 4 < int4_16.key_scale_bytes
    assert int4_16.half_block_bytes == 16 * 3 * 32 + 3 * 64 * 4
    int4_64 = KVSpec(30, 3, 64, 32, "int4", group_size=64)  # values' scales shorter: padded
    assert int4_64.half_block_bytes == 32 * 3 * 32 + 3 * 64 * 4
    layouts = {s.layout for s in (SMOLLM2, half, int8, int4, int4_16, int4_64)}
    assert len(layouts) == 6 and int4.dtype_tag == "i4kcg32"
    # capacity against float32 (the targets: >= 3.5x int8, >= 6x 4-bit)
    assert SMOLLM2.block_bytes / int8.block_bytes >= 3.5
    assert SMOLLM2.bytes_per_token / int4.bytes_per_token == 6.4
    assert SMOLLM2.bytes_per_token / int4_16.bytes_per_token < 6


def test_sizing_and_entries_use_the_spec():
    shape = KVShape(30, 9, 3, 64, "float32")
    assert shape.bytes_per_token == SMOLLM2.bytes_per_token
    fmt = serde.EntryFormat(SMOLLM2, "model", layer_groups=3)
    assert fmt.block_bytes == SMOLLM2.block_bytes
    assert sum(fmt.group_block_bytes(g) for g in range(3)) == SMOLLM2.block_bytes
    payload = 2 * 10 * SMOLLM2.layer_block_bytes
    assert fmt.entry_bytes(0, 2) == fmt.head_bytes(2) + payload + serde.TAG_SIZE


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_layers": 0}, "num_layers"), ({"dtype": "int3"}, "kv_cache_dtype"),
     ({"dtype": "int4", "group_size": 3}, "kv_int4_group_size"),
     ({"dtype": "int4", "group_size": 8}, "kv_int4_group_size"),
     ({"dtype": "int8", "group_size": 2}, "kv_int4_group_size"),
     ({"dtype": "int4", "block_size": 5}, "block_size")],
)  # fmt: skip
def test_bad_spec_names_the_field(kwargs, field):
    base = dict(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4)
    with pytest.raises(ValueError, match=f"^{field}:"):
        KVSpec(**{**base, **kwargs})


def test_the_registry_lists_each_format_once_by_use():
    from kvwise.core.kv_spec import kv_format, kv_formats

    assert kv_formats() == ("float32", "bfloat16", "float16", "int8", "int4")  # the pool's
    assert kv_formats("size") == (*kv_formats(), "fp8")  # fp8: a size only
    assert kv_formats("eval") == (*kv_formats(), "int4-pt")  # int4-pt: eval's round trip only
    int4 = kv_format("int4")
    assert int4.sealed_keys and int4.quantized and int4.default_block_size == 32
    assert kv_format("int8").quantized and not kv_format("float16").quantized
    assert KVSpec(1, 1, 4, 4, "fp8").block_bytes == 2 * 4 * 4  # sized, never stored
    with pytest.raises(ValueError, match="^kv_cache_dtype:"):
        KVSpec(1, 1, 4, 4, "int4-pt")  # measured by eval, neither stored nor sized
    with pytest.raises(ValueError, match="^kv_cache_dtype:"):
        kv_format("int3")
    with pytest.raises(ValueError, match="^use:"):
        kv_formats("disk")


def test_a_registered_format_needs_a_name_and_a_tag_of_its_own():
    from kvwise.core.kv_spec import KVFormat, Scales, register_kv_format, unregister_kv_format

    with pytest.raises(ValueError, match="registered already"):
        register_kv_format(KVFormat("int8", 1))
    with pytest.raises(ValueError, match="^tag:"):
        register_kv_format(KVFormat("int8b", 1, tag="int8"))  # int8's entries would be its own
    with pytest.raises(ValueError, match="^tag:"):
        KVFormat("x", 1, tag="a-very-long-tag")  # entry headers hold 8 characters
    with pytest.raises(ValueError, match="^per:"):
        Scales("block", 4)
    register_kv_format(KVFormat("i8x", 1, uses=("size",), key_scales=Scales("token", 2)))
    try:
        spec = KVSpec(2, 3, 8, 16, "i8x")
        assert spec.key_scale_bytes == 16 * 3 * 2 and spec.value_scale_bytes == 0
        assert spec.scale_bytes == spec.key_scale_bytes and spec.layout.endswith(".i8x")
    finally:
        unregister_kv_format("i8x")

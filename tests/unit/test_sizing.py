"""kvwise size: the seed article's example and the GQA / MQA reductions."""

import json
from types import SimpleNamespace

import pytest

from kvwise.cli import main
from kvwise.perf.sizing import KVShape, report, shape_from_model


def test_seed_article_example():
    shape = KVShape(num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, dtype="float16")
    assert shape.bytes_per_token == 524_288
    per_request = shape.bytes_per_token * 4096
    assert round(per_request / 1e9, 1) == 2.1
    assert round(per_request * 16 / 1e9) == 34
    text = report(shape, 4096, 16, None)
    assert "34.36 GB" in text and "2.15 GB" in text
    assert "| GQA | 8 | 128.0 KiB |" in text and "| MQA | 1 | 16.0 KiB |" in text


def test_smollm2_shape_from_config(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape, _ = shape_from_model(tmp_path, "float32")
    assert shape.bytes_per_token == 46_080  # 45 KiB, as DESIGN.md says
    assert shape.attention_kind == "GQA"


def test_errors_name_the_field(capsys):
    with pytest.raises(ValueError, match="^num_kv_heads:"):
        KVShape(32, 32, 5, 128)
    with pytest.raises(ValueError, match="^head_dim:"):
        KVShape(32, 32, 8, 0)
    assert main(["size", "--layers", "2", "--heads", "4"]) == 2
    assert "error: --layers:" in capsys.readouterr().err
    assert main(["size", "--model", "/nonexistent"]) == 2


def test_cli_prints_table(capsys):
    assert (
        main(
            [
                "size",
                "--layers",
                "32",
                "--heads",
                "32",
                "--head-dim",
                "128",
                "--kv-heads",
                "8",
                "--memory",
                "24GiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "(GQA)" in out and "requests of 4,096 tokens" in out


def test_every_kv_format_is_reported_with_its_scales(capsys):
    from kvwise.cli import main

    assert main(["size", "--layers", "30", "--heads", "9", "--kv-heads", "3", "--head-dim", "64",
                 "--memory", "1GiB", "--dtype", "int8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    # the format's own description (KVFormat.describe), not a list kept by ``kvwise size``
    assert (
        "1 B + scales: keys 4 B per token and KV head, values 4 B per token and KV head = 12,240 B"
    ) in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "46,080 B" in rows["float32"] and "12,240 B" in rows["int8"]
    assert "7,200 B" in rows["int4"]  # 2 x 30 x 3 x (32 + 8) B


def _tiny_gguf(path, arch="llama", key_length=None, per_layer_kv_heads=False):
    """A GGUF with a model's shape keys, a vocabulary (string arrays) and no tensors."""
    gguf = pytest.importorskip("gguf")

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(6)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_context_length(1024)
    writer.add_head_count(8)
    if per_layer_kv_heads:
        writer.add_array(f"{arch}.attention.head_count_kv", [2] * 6)
    else:
        writer.add_head_count_kv(2)
    if key_length is not None:
        writer.add_key_length(key_length)
    writer.add_vocab_size(300)
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_token_types([1] * 300)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("key_length", [None, 48])
def test_gguf_shape_read_from_metadata_alone_equals_the_full_readers(tmp_path, key_length):
    # kvwise size reads a GGUF's KV shape with struct alone (no torch, no vocabulary parsed);
    # it must be the shape ModelArchConfig.from_gguf reads from gguf's own reader
    import gguf

    from kvwise.models.arch_load import arch_from_gguf
    from kvwise.perf.gguf_meta import ARRAY, read_scalars

    path = _tiny_gguf(tmp_path / "tiny.gguf", key_length=key_length)
    meta = read_scalars(path)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 6
    assert meta["tokenizer.ggml.tokens"] is ARRAY
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    arch = arch_from_gguf(gguf.GGUFReader(path))
    shape, name = shape_from_model(path, "int8")
    assert name == "tiny.gguf"
    assert shape == KVShape(arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                            "int8")  # fmt: skip
    assert (shape.num_kv_heads, shape.head_dim) == (2, key_length or 256 // 8)


def test_gguf_shape_falls_back_to_the_full_reader(tmp_path, monkeypatch):
    from kvwise.perf import gguf_meta, sizing

    # head counts per layer (an array): the fast reader declines, the full reader decides
    path = _tiny_gguf(tmp_path / "layers.gguf", per_layer_kv_heads=True)
    assert sizing._gguf_shape(path, "float16") is None
    # not a GGUF, or cut short: no metadata, and the full reader's error
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\xff" * 8)
    assert gguf_meta.read_scalars(bad) is None
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert gguf_meta.read_scalars(tmp_path / "empty.gguf") is None
    called = []

    def full_reader(p):
        called.append(p)
        return SimpleNamespace(num_layers=1, num_heads=4, num_kv_heads=1, head_dim=8), p.name

    monkeypatch.setattr(sizing, "arch_from_model", full_reader)
    assert shape_from_model(bad, "float16") == (KVShape(1, 4, 1, 8), "bad.gguf")
    assert shape_from_model(path, "float16")[0] == KVShape(1, 4, 1, 8)
    assert called == [bad, path]

"""kvwise size: the seed article's example and the GQA / MQA reductions."""

import json

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
    assert "1 B + scales (4 B per token and KV head) = 12,240 B" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "46,080 B" in rows["float32"] and "12,240 B" in rows["int8"]
    assert "7,200 B" in rows["int4"]  # 2 x 30 x 3 x (32 + 8) B

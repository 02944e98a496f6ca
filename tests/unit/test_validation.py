"""Bad input gets a ValueError that names the field."""

import pytest

from kvwise.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvwise.types import SamplingParams
from kvwise.utils import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_errors_name_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edges():
    p = SamplingParams(max_tokens=1, temperature=0, top_p=1.0, min_p=0.0, top_k=-1, stop="x")
    assert p.greedy and p.stop == ("x",)


def test_missing_model_path():
    with pytest.raises(ValueError, match="^model: path '/nonexistent' does not exist"):
        ModelConfig(model="/nonexistent")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
        ({"kv_cache_memory": -1}, "kv_cache_memory"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": "x"}, "max_num_batched_tokens"),
        ({"prefill_chunk_size": 0}, "prefill_chunk_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_engine_config_errors_name_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig.from_kwargs(**kwargs)


def test_sizes():
    assert parse_bytes("2GiB", "x") == 2 * 1024**3
    assert parse_bytes("512MB", "x") == 512 * 10**6
    assert parse_bytes(1000, "x") == 1000
    assert format_bytes(46080) == "45.0 KiB"
    assert CacheConfig(kv_cache_memory="1KiB").kv_cache_bytes() == 1024
    assert CacheConfig().kv_cache_bytes() > 0
    assert SchedulerConfig().max_num_seqs == 64


def test_unreadable_public_system_prompt_file(capsys):
    from kvwise.cli import main

    assert main(["generate", "--public-system-prompt-file", "/nonexistent", "hi"]) == 2
    assert "--public-system-prompt-file: cannot read" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^public_system_prompts:"):
        EngineConfig.from_kwargs(public_system_prompts=("",))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tenant": ""}, "tenant"),
        ({"tenant": 3}, "tenant"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"retention": "soon"}, "retention"),
        ({"retention": -1}, "retention"),
        ({"session_id": ""}, "session_id"),
    ],
)
def test_request_options_errors_name_field_and_carry_400(kwargs, field):
    from kvwise.errors import InvalidRequest
    from kvwise.types import RequestOptions

    with pytest.raises(InvalidRequest, match=f"^{field}:") as info:
        RequestOptions(**kwargs)
    assert info.value.param == field and info.value.status == 400


def test_sampling_params_errors_are_typed_for_the_server():
    from kvwise.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as info:
        SamplingParams(top_p=2)
    assert (info.value.param, info.value.status) == ("top_p", 400)


def test_kv_cache_dtype_is_checked():
    assert CacheConfig(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="^kv_cache_dtype:"):
        CacheConfig(kv_cache_dtype="int3")

"""Defaults that fit the machine (kvwise/machine.py, issue 44): the KV pool sized from what the
scheduler's limits need and capped by the RAM available, a pool that cannot fit refused naming
``kv_cache_memory``, a default disk tier directory per server that falls back past one another
engine holds, its budget bounded by the free space, ``--chat-template`` checked at start, the
port checked before the model loads, and ``--version``."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from kvwise import machine
from kvwise.cli import main
from kvwise.cli.serve import check_port_free
from kvwise.config import EngineConfig, ModelConfig, StoreConfig, check_kv_disk_path_free
from kvwise.engine.chat_template import load_chat_template
from kvwise.store.disk_files import LOCK_NAME, lock_directory

GiB = 1 << 30


def per_token(num_bytes: int):
    """``seq_bytes`` of a layout with ``num_bytes`` a token."""
    return lambda num_tokens: num_tokens * num_bytes


def test_the_default_pool_holds_max_num_seqs_working_contexts_when_that_fits():
    pool = machine.default_pool(per_token(46080), 64, 8192, 20 * GiB, 0.2)
    assert pool.num_bytes == 64 * 1024 * 46080  # 2.8 GiB, not 20% of 20 GiB (4 GiB)
    assert "--max-num-seqs 64 x 1024 tokens" in pool.how and "under 20%" in pool.how


def test_the_default_pool_holds_one_whole_context_at_least():
    pool = machine.default_pool(per_token(1000), 2, 8192, 20 * GiB, 0.2)
    assert pool.num_bytes == 8192 * 1000  # not 2 x 1024 tokens
    short = machine.default_pool(per_token(1000), 4, 512, 20 * GiB, 0.2)
    assert short.num_bytes == 4 * 512 * 1000  # a context under 1,024 tokens: 512 a sequence


def test_the_default_pool_is_capped_by_the_ram_available():
    pool = machine.default_pool(per_token(46080), 64, 8192, 10 * GiB, 0.2)
    assert pool.num_bytes == 2 * GiB
    assert pool.how.startswith("20% of 10.0 GiB RAM available (wanted 2.8 GiB")


def test_a_pool_that_cannot_fit_names_kv_cache_memory_and_what_fits():
    machine.check_pool_fits(17 * GiB, 21 * GiB, GiB, estimated=True)  # under 21 x 0.9 - 1
    with pytest.raises(ValueError) as e:
        machine.check_pool_fits(40 * GiB, 23 * GiB, 100 << 20, estimated=True)
    assert str(e.value) == (
        "kv_cache_memory: 40.0 GiB does not fit: 23.0 GiB of RAM available, at most ~20.6 GiB "
        "for the KV pool beside the model's ~100.0 MiB of weights and 10% kept free"
    )
    with pytest.raises(ValueError, match=r"^kv_cache_memory: 19.0 GiB does not fit"):
        machine.check_pool_fits(19 * GiB, 21 * GiB, GiB, estimated=False)


def test_model_file_bytes_measures_a_gguf_or_a_directory_of_weights(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 50)
    (tmp_path / "config.json").write_text("{}")
    assert machine.model_file_bytes(tmp_path) == 150
    assert machine.model_file_bytes(tmp_path / "model.safetensors") == 100
    assert machine.model_file_bytes(tmp_path / "missing") == 0


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "kvwise"


def hold(directory) -> int:
    """Hold ``directory`` as a running engine's disk tier does (its flock): the fd."""
    os.makedirs(directory, exist_ok=True)
    return lock_directory(str(directory))


def test_the_default_disk_tier_is_one_per_server_and_one_for_the_rest(cache_home):
    assert StoreConfig(kv_disk_default_name="8000").kv_disk_path == str(cache_home / "kv-8000")
    assert StoreConfig(kv_disk_default_name="8001").kv_disk_path == str(cache_home / "kv-8001")
    assert StoreConfig().kv_disk_path == str(cache_home / "kv-local")
    assert EngineConfig.from_kwargs().store.kv_disk_path == str(cache_home / "kv-local")
    assert not (cache_home / "kv-local").exists()  # choosing it creates nothing
    with pytest.raises(ValueError, match="kv_disk_default_name"):
        StoreConfig(kv_disk_default_name="../x")


def test_a_default_directory_another_engine_holds_falls_back_to_the_next(cache_home):
    fd = hold(cache_home / "kv-local")
    try:
        config = StoreConfig()
        assert config.kv_disk_path == str(cache_home / "kv-local-2")
        assert "kv-local is in use by another kvwise engine" in config.kv_disk_how
        fds = [hold(cache_home / f"kv-local-{i}") for i in range(2, 9)]
        assert StoreConfig().kv_disk_path is None  # all eight held: the disk tier off
        for f in fds:
            os.close(f)
    finally:
        os.close(fd)
    assert StoreConfig().kv_disk_path == str(cache_home / "kv-local")  # released


def test_a_given_disk_path_another_engine_holds_is_an_error_naming_it(tmp_path):
    check_kv_disk_path_free(str(tmp_path / "nothing-here"))
    fd = hold(tmp_path / "tier")
    try:
        with pytest.raises(ValueError) as e:
            check_kv_disk_path_free(str(tmp_path / "tier"))
        assert str(e.value).startswith(
            f"kv_disk_path: {tmp_path / 'tier'} is in use by another kvwise engine "
            f"(pid {os.getpid()})"
        )
    finally:
        os.close(fd)
    check_kv_disk_path_free(str(tmp_path / "tier"))


def test_dir_owner_reads_a_lock_only_while_it_is_held(tmp_path):
    lock = tmp_path / LOCK_NAME
    lock.write_text("4242\n")
    assert machine.dir_owner(tmp_path, LOCK_NAME) is None  # a lock file left by a dead engine
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert machine.dir_owner(tmp_path, LOCK_NAME) == "4242"
    finally:
        os.close(fd)


def test_the_default_disk_budget_is_bounded_by_the_free_space(cache_home, monkeypatch):
    monkeypatch.setattr(machine, "free_disk_bytes", lambda path: 8 * GiB)
    config = StoreConfig(kv_disk_default_name="8000")
    assert config.kv_disk_size == 4 * GiB
    assert config.kv_disk_how == (
        "this server's own, port 8000; its budget 50% of the 8.0 GiB free there"
    )
    monkeypatch.setattr(machine, "free_disk_bytes", lambda path: 100 * GiB)
    assert StoreConfig().kv_disk_size == 20 * GiB
    assert StoreConfig(kv_disk_size="1GiB").kv_disk_size == GiB  # given: as given
    assert machine.free_disk_bytes(cache_home / "not" / "yet") > 0  # its nearest parent's


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    inline = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert load_chat_template(inline) == inline
    path = tmp_path / "chat.jinja"
    path.write_text(inline)
    assert load_chat_template(str(path)) == inline
    assert ModelConfig(chat_template=path).chat_template == str(path)
    with pytest.raises(ValueError) as e:
        ModelConfig(chat_template=str(tmp_path / "missing.jinja"))
    assert str(e.value) == (
        f"chat_template: cannot read '{tmp_path / 'missing.jinja'}': No such file or directory"
    )
    with pytest.raises(ValueError, match="^chat_template: cannot read .*: Is a directory$"):
        load_chat_template(str(tmp_path))
    path.write_text("{% for m in messages %}")
    with pytest.raises(ValueError) as e:
        load_chat_template(str(path))
    assert str(e.value).startswith("chat_template: not valid Jinja: ")
    assert "\n" not in str(e.value)


def test_a_port_in_use_is_named_before_anything_loads():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ValueError) as e:
            check_port_free("127.0.0.1", port)
        assert str(e.value).startswith(f"port: 127.0.0.1:{port} is already in use")
    check_port_free("127.0.0.1", port)  # closed: free again
    with pytest.raises(ValueError, match="^host: cannot listen on 192.0.2.1:"):
        check_port_free("192.0.2.1", port)  # TEST-NET-1: not an address of this machine


def test_version(capsys):
    from kvwise import __version__
    from kvwise.version import torch_version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvwise {__version__} (torch {torch_version()})"
    assert torch_version()  # the metadata of the installed torch, read without importing it


def test_the_pool_is_zeros_taken_page_by_page():
    import torch

    from kvwise.worker.kv_cache.base import zeroed_pool

    pool = zeroed_pool((2, 3, 1024, 16), torch.float32)
    assert pool.shape == (2, 3, 1024, 16) and pool.dtype == torch.float32
    assert torch.count_nonzero(pool) == 0
    pool[1, 2, 5] = 1.5
    assert pool.sum().item() == 1.5 * 16
    before = _rss_bytes()
    big = zeroed_pool((GiB // 4,), torch.float32)  # 1 GiB of address space, little RAM
    big[:: 1 << 20] = 2.0  # one page in every 4 MiB
    assert big.sum().item() == 2.0 * 256
    assert _rss_bytes() - before < 64 << 20


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")

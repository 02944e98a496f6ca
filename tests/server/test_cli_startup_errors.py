"""``kvwise serve`` with a path, secret or host it cannot use: one line naming the flag and
exit status 2, before the model loads, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvwise.cli import main

# NOTE: should a check let a bad flag through, binding this address (TEST-NET-1, not this
# machine's) fails once the model has loaded: a failed test, never a server left running
NO_SUCH_ADDRESS = ["--host", "192.0.2.1", "--port", "1"]


@pytest.fixture(autouse=True)
def no_secret_in_the_environment(monkeypatch):
    monkeypatch.delenv("KVWISE_KV_SECRET", raising=False)


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory\n")
    return path


def serve_error(capsys, tmp_path, *flags: str) -> str:
    """``kvwise serve`` with ``flags`` (and a temporary disk tier unless they name one): exit
    status 2 and one line on stderr, returned."""
    if "--kv-disk-path" not in flags:
        flags = ("--kv-disk-path", str(tmp_path / "tier"), *flags)
    assert main(["serve", *NO_SUCH_ADDRESS, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvwise: error: "), err
    return err[0].removeprefix("kvwise: error: ")


def test_a_disk_path_that_is_a_file(capsys, tmp_path, a_file):
    message = serve_error(capsys, tmp_path, "--kv-disk-path", str(a_file))
    assert message == f"--kv-disk-path: '{a_file}' is not a directory"
    message = serve_error(capsys, tmp_path, "--kv-disk-path", str(a_file / "kv"))
    assert (
        message == f"--kv-disk-path: cannot create '{a_file / 'kv'}': '{a_file}' is not a directory"
    )


def test_a_disk_tier_whose_secret_file_is_a_directory(capsys, tmp_path):
    secret = tmp_path / "tier" / ".kvwise.secret"
    secret.mkdir(parents=True)
    message = serve_error(capsys, tmp_path, "--kv-disk-path", str(tmp_path / "tier"))
    assert (
        message == f"--kv-disk-path: the disk tier's store secret '{secret}' is not a regular file"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="n/a: root reads and writes every file")
def test_paths_this_user_cannot_read(capsys, tmp_path, a_file):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    message = serve_error(capsys, tmp_path, "--kv-disk-path", str(locked))
    assert message.startswith("--kv-disk-path: ") and "read and write" in message
    a_file.chmod(0)
    message = serve_error(capsys, tmp_path, "--model", str(a_file))
    assert message == f"--model: cannot read '{a_file}': Permission denied"
    message = serve_error(capsys, tmp_path, "--public-system-prompt-file", str(a_file))
    assert message.startswith("--public-system-prompt-file: cannot read")


def test_a_model_path_that_does_not_exist(capsys, tmp_path):
    message = serve_error(capsys, tmp_path, "--model", str(tmp_path / "missing.gguf"))
    assert message == f"--model: path '{tmp_path / 'missing.gguf'}' does not exist"


def test_a_public_system_prompt_file_that_is_a_directory_or_missing(capsys, tmp_path):
    message = serve_error(capsys, tmp_path, "--public-system-prompt-file", str(tmp_path))
    assert message == f"--public-system-prompt-file: cannot read '{tmp_path}': Is a directory"
    missing = tmp_path / "missing.txt"
    message = serve_error(capsys, tmp_path, "--public-system-prompt-file", str(missing))
    assert message.startswith(f"--public-system-prompt-file: cannot read '{missing}'")


def test_a_weak_store_secret(capsys, tmp_path, monkeypatch):
    for weak in ("short", "0123456789abcdef0123456789abcdef"):  # `openssl rand -hex 16`
        message = serve_error(capsys, tmp_path, "--kv-store-secret", weak)
        assert message.startswith("--kv-store-secret: too weak") and weak not in message
    monkeypatch.setenv("KVWISE_KV_SECRET", "sixteen chars!!!")
    message = serve_error(capsys, tmp_path)
    assert message.startswith("kv_store_secret ($KVWISE_KV_SECRET): too weak")


def test_a_bad_allowed_host(capsys, tmp_path):
    message = serve_error(capsys, tmp_path, "--allowed-hosts", "localhost,http://x/")
    assert message.startswith("--allowed-hosts: 'http://x/' is not a host")


def test_generate_checks_its_paths_before_loading_too(capsys, a_file):
    assert main(["generate", "--kv-disk-path", str(a_file), "hi"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvwise: error: --kv-disk-path: '{a_file}' is not a directory"
    )


def test_the_real_command_exits_2_with_one_line(tmp_path):
    (tmp_path / "tier" / ".kvwise.secret").mkdir(parents=True)
    cmd = [sys.executable, "-m", "kvwise.cli", "serve", *NO_SUCH_ADDRESS]
    cmd += ["--kv-disk-path", str(tmp_path / "tier")]
    env = {k: v for k, v in os.environ.items() if k != "KVWISE_KV_SECRET"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("kvwise: error: --kv-disk-path: the disk tier's store secret")
    )

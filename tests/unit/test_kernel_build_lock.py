"""A kernel build killed mid-way leaves torch's lock file behind, and torch waits on it for
ever: the next start clears a stale lock, never one a running build holds."""

import os
import subprocess
import time
import types

from kvwise import kernels


def fake_torch(build_dir):
    return types.SimpleNamespace(_get_build_directory=lambda name, verbose: str(build_dir))


def lock_aged(build_dir, age_s: float):
    lock = build_dir / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_stale_lock_is_removed(tmp_path):
    lock = lock_aged(tmp_path, 120)
    kernels._clear_stale_lock(fake_torch(tmp_path), "kvwise_ops_x")
    assert not lock.exists()


def test_a_fresh_lock_is_kept(tmp_path):
    lock = lock_aged(tmp_path, 1)  # another process may be about to start its compiler
    kernels._clear_stale_lock(fake_torch(tmp_path), "kvwise_ops_x")
    assert lock.exists()


def test_a_lock_with_a_build_running_in_its_directory_is_kept(tmp_path):
    lock = lock_aged(tmp_path, 120)
    build = subprocess.Popen(["sleep", "30"], cwd=tmp_path)  # as ninja runs: in the directory
    try:
        time.sleep(0.1)
        kernels._clear_stale_lock(fake_torch(tmp_path), "kvwise_ops_x")
        assert lock.exists()
    finally:
        build.kill()
        build.wait()
    kernels._clear_stale_lock(fake_torch(tmp_path), "kvwise_ops_x")
    assert not lock.exists()


def test_no_lock_and_no_build_directory_are_fine(tmp_path):
    kernels._clear_stale_lock(fake_torch(tmp_path / "absent"), "kvwise_ops_x")

"""One engine per disk directory: a second one fails at start, naming the owner, before it
looks at (or deletes) a single file; the lock dies with its process."""

import os
import signal
import subprocess
import sys

import pytest

from kvwise.store.disk import DiskStore
from tests.store_util import key, value

HOLD = """
import sys
from kvwise.store.disk import DiskStore
store = DiskStore(sys.argv[1], 1 << 20)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_second_store_on_the_same_directory_fails_and_deletes_nothing(tmp_path):
    first = DiskStore(tmp_path, 1 << 20)
    first.put([(key(i), value(i, 1000)) for i in range(5)])
    files = sorted(p for p in tmp_path.rglob("*.kv"))
    assert len(files) == 5
    # a tiny budget would trim the directory at start, if the store got that far
    with pytest.raises(ValueError, match=rf"kv_disk_path: .* in use by .* \(pid {os.getpid()}\)"):
        DiskStore(tmp_path, 100)
    assert sorted(p for p in tmp_path.rglob("*.kv")) == files
    first.close()
    second = DiskStore(tmp_path, 1 << 20)  # free once the owner closed
    assert second.get([key(3)]) == [value(3, 1000)]
    second.close()


def test_the_lock_holds_across_processes_and_dies_with_its_owner(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        assert child.stdout.readline() == b"locked\n"
        with pytest.raises(ValueError, match=rf"\(pid {child.pid}\)"):
            DiskStore(tmp_path, 1 << 20)
        child.send_signal(signal.SIGKILL)  # a crash: no close, no cleanup
        child.wait(10)
        DiskStore(tmp_path, 1 << 20).close()  # the kernel released the lock
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

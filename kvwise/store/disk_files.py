"""The disk tier's files: names, reads, the directory's owner lock and the scan at start. No
index or budget: ``disk.DiskStore`` owns those and decides what a failure means.

- ``<root>/<first 2 hex chars of key>/<64-hex key>.kv`` holds an entry's bytes as given;
  temporaries (``*.tmp``) sit next to it until renamed over it.
- atime is the entry's last use (set explicitly, so it does not depend on mount options);
  mtime is its keep time (in the future: kept until then).
- ``read`` returns an ``OSError`` instead of raising it (it runs on the store's I/O threads,
  which hand results back in a batch).
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass

from kvwise.store.base import BuffersFor

SUFFIX = ".kv"
LOCK_NAME = ".kvwise.lock"  # held (flock) by the engine that owns the directory
SECRET_NAME = ".kvwise.secret"  # the directory's own store secret (mode 0600)
_UTIME_FD = os.utime in os.supports_fd
_IOV_MAX = 1024


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


def error_kind(op: str, exc: OSError) -> str:
    """What a fault is logged (once) as, e.g. "write ENOSPC"."""
    return f"{op} {errno.errorcode.get(exc.errno or 0, type(exc).__name__)}"


def entry_path(root: str, key: bytes) -> str:
    name = key.hex()
    return os.path.join(root, name[:2], name + SUFFIX)


def key_of(name: str, subdir: str) -> bytes | None:
    """The key of a file the store wrote, from its name; None for any other file."""
    hex_key = name[:64]
    if len(name) != 64 + len(SUFFIX) or not name.endswith(SUFFIX):
        return None
    try:
        key = bytes.fromhex(hex_key)
    except ValueError:
        return None
    return key if key.hex() == hex_key and hex_key[:2] == subdir else None


def read(path: str, now: float, into: BuffersFor | None = None):
    """The file's bytes (fewer if it shrank while read), or the buffers ``into`` gave
    (filled; ``[]`` when it gave none: nothing read), or the ``OSError``. Sets atime to
    ``now`` (not when nothing was read)."""
    try:
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            if into is not None:
                buffers = into(st.st_size)
                if buffers is None:
                    return []
                _preadv_all(f.fileno(), buffers)
                result = buffers
            else:
                result = _read_all(f, st.st_size)
            target = f.fileno() if _UTIME_FD else path
            os.utime(target, ns=(ns(now), st.st_mtime_ns))
    except OSError as exc:
        return exc
    return result


def _read_all(f, size: int) -> bytearray:
    buf = bytearray(size)
    num_read = 0
    with memoryview(buf) as view:
        while num_read < len(buf):
            n = f.readinto(view[num_read:])
            if not n:
                break
            num_read += n
    return buf if num_read == len(buf) else buf[:num_read]


def _preadv_all(fd: int, buffers: list) -> None:
    """Fill ``buffers`` in order from the start of the file (short reads continued; a file
    that ends early leaves the rest as it was, for the caller's checksum to catch)."""
    views = [memoryview(b).cast("B") for b in buffers]
    offset = 0
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        want = sum(v.nbytes for v in batch)
        got = os.preadv(fd, batch, offset)
        offset += got
        if got == want:
            i += len(batch)
            continue
        if got == 0:
            return
        # a short read: skip the buffers filled, resume inside the next one
        for j, v in enumerate(batch):
            if got < v.nbytes:
                views[i + j] = v[got:]
                i += j
                break
            got -= v.nbytes


@dataclass(frozen=True)
class Found:
    """An entry file found by ``scan``."""

    atime_ns: int
    key: bytes
    num_bytes: int
    mtime: float  # seconds


def lock_directory(root: str) -> int:
    """Take the directory for this process: an exclusive ``flock`` on its lock file, which
    also records the owner's pid. Returns the lock's fd (closing it releases the lock; the
    kernel releases it when the process dies, so a crash leaves no stale lock).

    Raises:
        ValueError: another engine holds the directory (naming its pid).
    """
    fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(
            f"kv_disk_path: {root} is in use by another kvwise engine (pid {owner}); give "
            "each engine a directory of its own, or share KV between engines through Redis"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def local_secret(root: str) -> bytes:
    """The directory's store secret: 32 random bytes made on first use, readable by its
    owner only (0600). Call with the directory locked."""
    path = os.path.join(root, SECRET_NAME)
    try:
        with open(path, "rb") as f:
            secret = f.read()
        if len(secret) == 32:
            return secret
    except FileNotFoundError:
        pass
    secret = os.urandom(32)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return secret


def scan(root: str) -> tuple[list[Found], list[str]]:
    """The entry files under ``root``, least recently used first, and the temporaries left
    there (by a crash). Other files are ignored; a file that vanishes meanwhile is skipped."""
    found, temporaries = [], []
    with os.scandir(root) as subs:
        subdirs = [s.path for s in subs if len(s.name) == 2 and s.is_dir(follow_symlinks=False)]
    for subdir in subdirs:
        with os.scandir(subdir) as entries:
            for entry in entries:
                if entry.name.endswith(".tmp"):
                    temporaries.append(entry.path)
                    continue
                key = key_of(entry.name, os.path.basename(subdir))
                if key is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append(Found(st.st_atime_ns, key, st.st_size, st.st_mtime_ns / 1e9))
    found.sort(key=lambda f: (f.atime_ns, f.key))
    return found, temporaries

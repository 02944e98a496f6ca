"""What this machine has, and the defaults sized to it. No torch; plain numbers in and out.

- Memory: ``available_memory_bytes`` (MemAvailable). The KV pool's default (``default_pool``)
  holds what the model and the engine's limits need: ``max_num_seqs`` sequences of
  ``DEFAULT_SEQ_TOKENS`` tokens (a chat turn's working context; sequences past it share the
  pool, and the KV tiers below hold what it evicts), and at least one whole ``max_model_len``
  sequence, capped at ``kv_cache_memory_fraction`` of the RAM available. An explicit
  ``kv_cache_memory`` must fit (``check_pool_fits``): beside the weights and a tenth of the
  available RAM kept free, else a ValueError naming it, before the model loads (the weights
  estimated by their files' size, ``model_file_bytes``) and again after (by what they hold).
- Disk: the default disk tier is a directory per server under ``$XDG_CACHE_HOME/kvwise``
  (``kv-<port>``; ``kv-local`` for ``kvwise generate`` / ``LLM(...)``), the first of
  ``kv-<name>``, ``kv-<name>-2``, ... ``kv-<name>-8`` that no running engine holds (the disk
  tier's ``flock``; ``dir_owner``), so two kvwise processes never collide; its default budget
  is ``DEFAULT_DISK_BYTES`` or half the free space of that file system, whichever is smaller.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from kvwise.utils import format_bytes

DEFAULT_SEQ_TOKENS = 1024  # tokens each of max_num_seqs sequences gets in the default pool
POOL_HEADROOM_FRACTION = 0.1  # of the available RAM, kept free beside the weights and the pool
DEFAULT_DISK_BYTES = 20 << 30  # the disk tier's default budget, at most
DISK_FREE_FRACTION = 0.5  # ... and at most this share of its file system's free space
DISK_CANDIDATES = 8  # kv-<name>, kv-<name>-2, ... kv-<name>-8


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo, else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB"


# ---- the KV pool ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolSize:
    """The KV pool's bytes and, for the start-up log, how they were chosen."""

    num_bytes: int
    how: str


def default_pool(
    seq_bytes, max_num_seqs: int, max_model_len: int, available: int, fraction: float
) -> PoolSize:
    """The default pool: ``max_num_seqs`` sequences of ``DEFAULT_SEQ_TOKENS`` tokens and at
    least one of ``max_model_len`` (``seq_bytes(num_tokens)``: the KV bytes one sequence of
    that many tokens holds, every KV group), at most ``fraction`` of ``available``."""
    per_seq = min(max_model_len, DEFAULT_SEQ_TOKENS)
    need = max(max_num_seqs * seq_bytes(per_seq), seq_bytes(max_model_len))
    why = (
        f"--max-num-seqs {max_num_seqs} x {per_seq} tokens, at least one --max-model-len "
        f"{max_model_len} sequence"
    )
    cap = int(available * fraction)
    if need <= cap:
        return PoolSize(need, f"{why}; under {fraction:.0%} of {_gib(available)} RAM available")
    return PoolSize(
        cap, f"{fraction:.0%} of {_gib(available)} RAM available (wanted {_gib(need)} for {why})"
    )


def pool_limit(available: int, model_bytes: int) -> int:
    """The largest KV pool that fits beside ``model_bytes`` of weights, keeping
    ``POOL_HEADROOM_FRACTION`` of ``available`` free."""
    return max(0, int(available * (1 - POOL_HEADROOM_FRACTION)) - model_bytes)


def check_pool_fits(pool_bytes: int, available: int, model_bytes: int, estimated: bool) -> None:
    """ValueError naming ``kv_cache_memory`` unless ``pool_bytes`` fits (``pool_limit``);
    ``estimated``: ``model_bytes`` is the weight files' size (before the model loads)."""
    limit = pool_limit(available, model_bytes)
    if pool_bytes <= limit:
        return
    weights = ("~" if estimated else "") + format_bytes(model_bytes)
    raise ValueError(
        f"kv_cache_memory: {_gib(pool_bytes)} does not fit: {_gib(available)} of RAM available, "
        f"at most ~{_gib(limit)} for the KV pool beside the model's {weights} of weights and "
        f"{POOL_HEADROOM_FRACTION:.0%} kept free"
    )


def model_file_bytes(path: str | Path) -> int:
    """The size of a model's weight files: a ``.gguf`` file, or an HF directory's
    ``*.safetensors`` (else ``*.bin``); 0 when there is nothing to measure."""
    path = Path(path)
    try:
        if path.is_file():
            return path.stat().st_size
        files = list(path.glob("*.safetensors")) or list(path.glob("*.bin"))
        return sum(f.stat().st_size for f in files)
    except OSError:
        return 0


# ---- the disk tier ----------------------------------------------------------------------------


def kvwise_cache_dir() -> str:
    """``$XDG_CACHE_HOME/kvwise`` (``~/.cache/kvwise`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvwise")


def dir_owner(path: str | Path, lock_name: str) -> str | None:
    """The pid (as its lock file says) of the engine holding the disk tier directory ``path``
    (an exclusive ``flock`` on ``path/lock_name``), or None when none does. Creates nothing."""
    try:
        fd = os.open(os.path.join(path, lock_name), os.O_RDONLY)
    except OSError:
        return None  # no directory or no lock file: nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def free_directory(name: str, lock_name: str, root: str | None = None) -> str | None:
    """The first of ``root/kv-<name>``, ``kv-<name>-2``, ... ``kv-<name>-8`` that no engine
    holds (``root``: ``kvwise_cache_dir()``), or None when every one is held."""
    root = root or kvwise_cache_dir()
    for i in range(1, DISK_CANDIDATES + 1):
        path = os.path.join(root, f"kv-{name}" + (f"-{i}" if i > 1 else ""))
        if dir_owner(path, lock_name) is None:
            return path
    return None


def free_disk_bytes(path: str | Path) -> int | None:
    """Free bytes (for this user) of the file system ``path`` is, or would be created, on."""
    path = Path(path).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def default_disk_size(path: str | Path) -> PoolSize:
    """The disk tier's default budget at ``path``: ``DEFAULT_DISK_BYTES``, or
    ``DISK_FREE_FRACTION`` of its file system's free space when that is less."""
    free = free_disk_bytes(path)
    if free is None:
        return PoolSize(DEFAULT_DISK_BYTES, "the default")
    if free * DISK_FREE_FRACTION >= DEFAULT_DISK_BYTES:
        return PoolSize(
            DEFAULT_DISK_BYTES,
            f"the default, under {DISK_FREE_FRACTION:.0%} of the {_gib(free)} free there",
        )
    return PoolSize(
        int(free * DISK_FREE_FRACTION), f"{DISK_FREE_FRACTION:.0%} of the {_gib(free)} free there"
    )

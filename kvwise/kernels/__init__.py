"""kvwise's own CPU kernels (``csrc/*.cpp``), compiled on first use and cached.

``available()`` builds the extension once per process (torch's ``cpp_extension`` with ninja
and the system C++ compiler; about a minute the first time, then loaded from torch's
extension cache, keyed by the sources and flags) and registers its ops under
``torch.ops.kvwise``. When no compiler is there, the build fails, or ``KVWISE_KERNELS=0`` is
set, it returns False with one warning and the callers keep their plain-torch paths, which
compute the same results more slowly.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "fused.cpp",
        "kv_int4.cpp",
        "dense.cpp",
        "kquant.cpp",
        "gguf_pack.cpp",
        "amx.cpp",
    )
]
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_flags() -> list[str]:
    """AVX2/FMA/F16C code when this CPU reports all three (never -march=native: some CPUs
    advertise instructions they trap on)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set()
    for line in info.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= flags else []


_VNNI_PROBE = r"""
#include <immintrin.h>
int main() {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b);
  __m512 f = _mm512_cvtph_ps(_mm256_set1_epi16(0x3c00));
  return (_mm512_reduce_add_epi32(s) == -384 && _mm512_reduce_add_ps(f) == 16.f) ? 0 : 1;
}
"""
_VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]


def _vnni_flags(base: list[str]) -> list[str]:
    """AVX-512 VNNI for the block matmuls when a test program using it compiles AND runs here
    (a CPU can report instructions it traps on: only running them tells), else nothing.
    ``KVWISE_AVX512=0`` keeps the AVX2 build."""
    if not base or os.environ.get("KVWISE_AVX512", "1") == "0":
        return []
    compiler = os.environ.get("CXX", "c++")
    if not _runs(compiler, [*base, *_VNNI_FLAGS], _VNNI_PROBE):
        return []
    # 256-bit vectors elsewhere, as in the AVX2 build: only the VNNI kernels use 512
    return [
        *_VNNI_FLAGS,
        "-mprefer-vector-width=256",
        "-DKVWISE_AVX512VNNI",
        *_amx_flags(compiler, base),
    ]


_AMX_PROBE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
struct alignas(64) Config { unsigned char palette, start, pad[14]; unsigned short colsb[16];
                            unsigned char rows[16]; };
int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;  // ask for the tile state
  Config c = {};
  c.palette = 1;
  for (int t = 0; t < 3; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
  alignas(64) signed char a[16 * 64], b[16 * 64];
  alignas(64) int s[16 * 16];
  for (int i = 0; i < 16 * 64; ++i) a[i] = 3, b[i] = -2;
  _tile_loadd(0, a, 64);
  _tile_loadd(1, b, 64);
  _tile_zero(2);
  _tile_dpbssd(2, 0, 1);
  _tile_stored(2, s, 64);
  _tile_release();
  return s[0] == -384 && s[255] == -384 ? 0 : 1;
}
"""
_AMX_FLAGS = ["-mamx-tile", "-mamx-int8"]


def _amx_flags(compiler: str, base: list[str]) -> list[str]:
    """AMX int8 tiles for the block matmuls of many rows (``csrc/amx.cpp``) when a test program
    that asks the kernel for the tile state and multiplies two tiles compiles AND runs here,
    else nothing. ``KVWISE_AMX=0`` keeps the VNNI build."""
    if os.environ.get("KVWISE_AMX", "1") == "0":
        return []
    if not _runs(compiler, [*base, *_VNNI_FLAGS, *_AMX_FLAGS], _AMX_PROBE):
        return []
    return [*_AMX_FLAGS, "-DKVWISE_AMX"]


def _runs(compiler: str, flags: list[str], source: str) -> bool:
    """Whether `source` compiles with `flags` and its program exits 0 here."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        src.write_text(source)
        try:
            subprocess.run(
                [compiler, "-O1", *flags, str(src), "-o", str(exe)],
                check=True,
                capture_output=True,
                timeout=60,
            )
            return subprocess.run([str(exe)], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def block_isa(isa: str = "") -> str:
    """The instructions of the int4 / int8-block matmuls: ``"amx"`` (AMX tiles from 16 rows,
    VNNI below), ``"avx512vnni"`` or ``"avx2"``;
    ``isa`` switches between them where both are built (the same results either way)."""
    if not available():
        raise RuntimeError("block_isa: the kvwise kernels are unavailable")
    return torch.ops.kvwise.block_isa(isa)


def attention_isa(isa: str = "") -> str:
    """The width of the paged attention kernels: ``"avx512"`` (16 lanes, each lane the AVX2
    lane's chain) or ``"avx2"``; ``isa`` switches where both are built (the same bits)."""
    if not available():
        raise RuntimeError("attention_isa: the kvwise kernels are unavailable")
    return torch.ops.kvwise.attention_isa(isa)


def block_isas() -> list[str]:
    """Every ``block_isa`` this build and CPU can run, slowest first (the current one kept)."""
    current, found = block_isa(), []
    for isa in ("avx2", "avx512vnni", "amx"):
        try:
            block_isa(isa)
            found.append(isa)
        except RuntimeError:
            pass
    block_isa(current)
    return found


def _header_stamp() -> str:
    """A define that changes with the shared headers: torch rebuilds when sources or flags
    change, and would not notice an edit to a header alone."""
    digest = hashlib.sha256()
    for header in sorted(_SOURCES[0].parent.glob("*.h")):
        digest.update(header.read_bytes())
    return f"-DKVWISE_VEC_H={digest.hexdigest()[:12]}"


def available() -> bool:
    """True once ``torch.ops.kvwise`` holds the kernels (built or loaded on the first call)."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
    return _state["ok"]


def runs_on(t: torch.Tensor) -> bool:
    """True where the kernels can compute with ``t``: built, and ``t`` on the CPU (they are
    registered for the CPU dispatch key only; another device keeps the plain-torch paths)."""
    return t.is_cpu and available()


def _build() -> bool:
    if os.environ.get("KVWISE_KERNELS", "1") == "0":
        log.info("kvwise kernels off (KVWISE_KERNELS=0): plain torch attention")
        return False
    try:
        from torch.utils import cpp_extension

        start = time.perf_counter()
        with _our_ninja():
            _load(cpp_extension)
        torch.ops.kvwise.paged_decode_attention  # noqa: B018 - raises if registration failed
        log.info("kvwise kernels ready in %.1f s", time.perf_counter() - start)
        return True
    except Exception as exc:  # a missing compiler or ninja: the torch paths still work
        log.warning(
            "kvwise kernels unavailable (%s): plain torch attention, slower decode",
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return False


@contextlib.contextmanager
def _our_ninja():
    """Build with the ninja kvwise depends on (the ``ninja`` package), never a system one: two
    ninja versions sharing torch's build directory discard each other's dependency logs, so
    processes with different PATHs would rebuild the kernels every time they alternate."""
    try:
        import ninja
    except ImportError:
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def _load(cpp_extension) -> None:
    cpu = _cpu_flags()
    flags = ["-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only", *cpu, *_vnni_flags(cpu)]
    # one build directory per checkout: two checkouts sharing one would rebuild alternately
    where = hashlib.sha256(str(_SOURCES[0].parent).encode()).hexdigest()[:8]
    _clear_stale_lock(cpp_extension, f"kvwise_ops_{where}")
    cpp_extension.load(
        name=f"kvwise_ops_{where}",
        sources=[str(s) for s in _SOURCES],
        extra_include_paths=[str(_SOURCES[0].parent)],
        extra_cflags=[*flags, _header_stamp()],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


_LOCK_GRACE_S = 30.0  # a build's lock younger than this may not have started its compiler yet
_LOCK_MAX_S = 1800.0  # no build of these kernels takes this long


def _clear_stale_lock(cpp_extension, name: str) -> None:
    """Remove the lock file a killed build left in torch's build directory (torch waits on it
    for ever: a Ctrl-C during the first build hung every later start). Stale: older than
    ``_LOCK_GRACE_S`` with no process working in that directory, or older than
    ``_LOCK_MAX_S``."""
    try:
        build_dir = cpp_extension._get_build_directory(name, False)
    except Exception:  # noqa: BLE001 - a private torch helper: without it, torch's own wait
        return
    lock = os.path.join(build_dir, "lock")
    try:
        age_s = time.time() - os.stat(lock).st_mtime
    except OSError:
        return  # no lock: nothing to clear
    if age_s < _LOCK_GRACE_S or (age_s < _LOCK_MAX_S and _building_in(build_dir)):
        return
    log.warning("kvwise kernels: removing a stale build lock (%.0f s old): %s", age_s, lock)
    with contextlib.suppress(OSError):
        os.unlink(lock)


def _building_in(build_dir: str) -> bool:
    """Whether a process runs in ``build_dir`` (torch runs ninja, and ninja the compiler,
    there). Linux; True elsewhere, so that only the age decides."""
    if not os.path.isdir("/proc"):
        return True
    target = os.path.realpath(build_dir)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/cwd") == target:
                    return True
    return False

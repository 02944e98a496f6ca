"""Grammar compiles under a deadline: each first runs in a worker process that a timeout or a
hang-up kills. No torch.

llguidance builds a grammar's lexer in Rust, without fuel for that phase and without the GIL:
a 22 KB ``patternProperties`` schema takes minutes, and a thread cannot be stopped. So a
constraint the server has not seen from this tenant is first compiled in a worker process
(``python -m kvwise.engine.grammar_workers``, at lower CPU priority), which is killed, and
replaced, when the request's deadline passes or its client goes away.

CPU priority: a worker starts (reading the vocabulary, ~0.5 s) and waits in Linux's idle
scheduling class (``SCHED_IDLE``: it runs when no other task wants the CPU), and a compile
goes to a worker that has started if there is one; a compile runs at nice 10
for its first ``DEMOTE_AFTER_S`` (a usual schema compiles in milliseconds), then back in the
idle class until it ends or is killed. A slow schema thus costs the engine's steps nothing
measurable (at nice 10 alone, two of them in a row doubled another tenant's TTFT p99: the
step's two torch threads wait for each other, and a worker taking one core's slice delays
both). Where the class cannot be changed (another OS, or no permission to leave the idle
class), the worker keeps its nice 10 or stays idle: slower compiles, never a wrong one. Only a constraint the
worker compiled in time is then compiled in the engine's own process (``structured.py``), so
that compile is bounded by the deadline too.

``GrammarWorkers`` also holds the compile slots: at most ``workers`` compiles at once, at
most ``per_tenant`` of them one tenant's, so one tenant cannot occupy every worker. A caller
takes a slot (``try_acquire``, never blocking), runs ``check`` and releases it.

The protocol is JSON lines on the worker's stdin and stdout: the worker first answers
``{"ready": true}``, then one reply per ``{"kind", "value", "field", "limits"}`` request:
``{"error": str | null, "seconds": float}``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

WORKER_NICE = 10  # the workers' (and the in-process compile threads') CPU niceness
# a compile still running after this long is one the engine's steps must not wait behind:
# its worker goes to the idle scheduling class (it runs only on a CPU nothing else wants)
DEMOTE_AFTER_S = 0.1
_POLL_S = 0.05  # how often a waiting caller looks at its cancel event
START_TIMEOUT_S = 60.0  # a worker's start (reading a 262k vocabulary: ~1 s)


class CompileTimeout(Exception):
    """The compile ran past its deadline (the worker was killed)."""


class CompileCancelled(Exception):
    """The caller went away (the worker was killed)."""


class WorkerFailed(Exception):
    """The worker process died or answered nonsense."""


@dataclass(frozen=True)
class CompileCheck:
    error: str | None  # llguidance's (or the schema's) error; None: it compiled
    seconds: float  # the worker's compile time


class _Worker:
    """One worker process and the bytes it has written that were not read yet."""

    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1")
        self.proc = subprocess.Popen(  # noqa: S603 (our own interpreter and module)
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.ready = False
        self._buffer = b""

    def _read(
        self, deadline: float, cancelled: threading.Event | None, demote_at: float | None = None
    ) -> dict[str, Any]:
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._buffer:
            if cancelled is not None and cancelled.is_set():
                raise CompileCancelled()
            if demote_at is not None and time.monotonic() >= demote_at:
                set_idle(self.proc.pid, True)
                demote_at = None
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise CompileTimeout()
            readable, _, _ = select.select([fd], [], [], min(_POLL_S, left_s))
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise WorkerFailed(f"the grammar worker exited ({self.proc.poll()})")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            raise WorkerFailed(f"the grammar worker answered {line[:80]!r}") from None

    def check(self, job: dict[str, Any], timeout_s: float, cancelled) -> CompileCheck:
        if not self.ready:  # its start does not count against the compile's deadline
            try:
                self._read(time.monotonic() + START_TIMEOUT_S, cancelled)
            except CompileTimeout:
                raise WorkerFailed(
                    f"the grammar worker did not start in {START_TIMEOUT_S} s"
                ) from None
            self.ready = True
        set_idle(self.proc.pid, False)  # nice 10 for the compile's first DEMOTE_AFTER_S
        try:
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError as exc:
            raise WorkerFailed(f"the grammar worker is gone: {exc}") from None
        now = time.monotonic()
        try:
            reply = self._read(now + timeout_s, cancelled, now + DEMOTE_AFTER_S)
        finally:
            set_idle(self.proc.pid, True)  # waiting for the next compile
        return CompileCheck(reply.get("error"), float(reply.get("seconds", 0.0)))

    def started(self) -> bool:
        """Whether it has said it is ready (read now if it has, never waiting)."""
        if not self.ready and self.proc.poll() is None:
            fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
            if select.select([fd], [], [], 0)[0]:
                try:
                    self._read(time.monotonic() + 1.0, None)
                    self.ready = True
                except (CompileTimeout, WorkerFailed):
                    pass
        return self.ready

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class GrammarWorkers:
    """Worker processes that compile constraints over one vocabulary, and the compile slots.

    Args:
        tokenizer_json: the vocabulary (a ``tokenizers`` JSON); written once to a private temp
            file each worker reads at start.
        n_vocab, eos_token_ids: as ``llguidance.LLTokenizer`` takes them.
        workers: compiles at once (and worker processes kept).
        per_tenant: compiles at once of one tenant.
    """

    def __init__(
        self,
        tokenizer_json: str,
        n_vocab: int,
        eos_token_ids: list[int],
        *,
        workers: int = 2,
        per_tenant: int = 1,
    ) -> None:
        if workers < 1 or per_tenant < 1:
            raise ValueError(
                f"grammar workers: workers and per_tenant must be >= 1, got "
                f"{workers} and {per_tenant}"
            )
        self.workers = workers
        self.per_tenant = per_tenant
        fd, self._vocab_path = tempfile.mkstemp(prefix="kvwise-vocab-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tokenizer_json)
        eos = ",".join(str(i) for i in eos_token_ids)
        self._argv = [sys.executable, "-m", __name__, self._vocab_path, str(n_vocab), eos]
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: dict[str, int] = {}
        self._spawned = 0
        self.num_killed = 0
        self._finalizer = weakref.finalize(self, _shut, self._idle, self._vocab_path)

    # ---- slots --------------------------------------------------------------------------

    def try_acquire(self, tenant: str) -> bool:
        """Take a compile slot for ``tenant`` if one is free (never blocks)."""
        with self._lock:
            if sum(self._busy.values()) >= self.workers:
                return False
            if self._busy.get(tenant, 0) >= self.per_tenant:
                return False
            self._busy[tenant] = self._busy.get(tenant, 0) + 1
            return True

    def release(self, tenant: str) -> None:
        with self._lock:
            left = self._busy.get(tenant, 0) - 1
            if left > 0:
                self._busy[tenant] = left
            else:
                self._busy.pop(tenant, None)

    def busy(self, tenant: str | None = None) -> int:
        """Compiles running now (of one tenant, or all)."""
        with self._lock:
            if tenant is not None:
                return self._busy.get(tenant, 0)
            return sum(self._busy.values())

    # ---- work ---------------------------------------------------------------------------

    def check(
        self, job: dict[str, Any], timeout_s: float, cancelled: threading.Event | None = None
    ) -> CompileCheck:
        """Compile ``job`` in a worker within ``timeout_s`` (once the worker has started);
        the caller holds a slot. Raises CompileTimeout / CompileCancelled (the worker killed
        and replaced) or WorkerFailed."""
        with self._lock:
            # one that has started first (a replacement reads the vocabulary in the idle
            # class: under load that takes a while)
            self._idle.sort(key=lambda w: w.started())
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = self._spawn()
        try:
            result = worker.check(job, timeout_s, cancelled)
        except BaseException:
            worker.kill()
            with self._lock:
                self.num_killed += 1
                if len(self._idle) < self.workers:  # a warm replacement for the next compile
                    self._idle.append(self._spawn())
            raise
        with self._lock:
            self._idle.append(worker)
        return result

    def warm(self) -> None:
        """Start every worker now (they read the vocabulary while nothing waits for them)."""
        with self._lock:
            while len(self._idle) < self.workers:
                self._idle.append(self._spawn())

    def _spawn(self) -> _Worker:
        self._spawned += 1
        return _Worker(self._argv)

    @property
    def num_spawned(self) -> int:
        return self._spawned

    def close(self) -> None:
        """Stop the worker processes and remove the vocabulary file. Idempotent."""
        self._finalizer()


def _shut(idle: list[_Worker], vocab_path: str) -> None:
    for worker in idle:
        worker.kill()
    idle.clear()
    try:
        os.unlink(vocab_path)
    except OSError:
        pass


def set_idle(pid: int, idle: bool) -> bool:
    """Put every thread of process ``pid`` in the idle scheduling class (or back in the normal
    one; its nice value stays). False where that is not possible (not Linux, no permission,
    the process gone)."""
    policy = getattr(os, "SCHED_IDLE" if idle else "SCHED_OTHER", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    ok = True
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:
            ok = False
    return ok


def nice_this_thread(increment: int = WORKER_NICE) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread is a task of its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), increment)
    except (AttributeError, OSError):
        pass


def _compile_job(tokenizer: Any, job: dict[str, Any]) -> str | None:
    """The worker's compile of one request: its error text, or None."""
    import llguidance

    from kvwise.engine.structured import first_mask_error, grammar_text
    from kvwise.errors import InvalidRequest
    from kvwise.types import StructuredOutput

    try:
        text = grammar_text(StructuredOutput(job["kind"], job["value"], job["field"]))
    except InvalidRequest as exc:
        return exc.detail
    except Exception as exc:  # noqa: BLE001 (llguidance's errors are its own kinds)
        return f"invalid {job['kind']}: {exc}"
    limits = llguidance.LLParserLimits(**job["limits"])
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
    if matcher.is_error():
        return f"invalid {job['kind']}: {matcher.get_error()[:500]}"
    return first_mask_error(matcher, job["kind"])


def _serve(vocab_path: str, n_vocab: str, eos: str) -> None:
    """The worker process: build the vocabulary once, then compile what stdin sends."""
    os.nice(WORKER_NICE)
    set_idle(os.getpid(), True)  # its start: the parent moves it while it compiles
    import llguidance

    with open(vocab_path, encoding="utf-8") as f:
        tokenizer = llguidance.LLTokenizer(
            f.read(), n_vocab=int(n_vocab), eos_token=[int(i) for i in eos.split(",")]
        )
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        start = time.perf_counter()
        error = _compile_job(tokenizer, json.loads(line))
        reply = {"error": error, "seconds": time.perf_counter() - start}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve(*sys.argv[1:4])

"""Fakes for tests of the engine, the async engine and the HTTP app without a model (and
without torch): a byte tokenizer, whole engines assembled around the ``FakeModelRunner``, and
``ControlledRunner``, a wrapper that lets a test hold, slow down or break the steps of any
runner (fake or real) that it is built with: no patching of ``execute``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvwise.config import EngineConfig
from kvwise.core.runner import ModelRunner
from kvwise.engine.assemble import assemble_engine
from kvwise.engine.chat_template import check_messages, check_rendered_length
from kvwise.engine.llm_engine import LLMEngine
from kvwise.worker.fake_runner import FakeModelRunner

EOS = 256


class ByteTokenizer:
    """Text ↔ UTF-8 bytes (ids 0-255), one special id (256: end of sequence). Chat messages
    render as ``role: content\\n`` lines."""

    vocab_size = 257
    max_token_chars = 1
    eos_token_ids = frozenset({EOS})
    special_token_ids = frozenset({EOS})

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i != EOS)
        return data.decode(errors="replace")

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        max_chars=None,
        tools=None,
        answers=None,  # (RecentAnswers: byte ids are their text's, nothing to reuse)
    ) -> list[int]:
        check_messages(messages)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        text += "assistant: " if add_generation_prompt else ""
        check_rendered_length(text, max_chars)
        return self.encode(text)


class ControlledRunner:
    """Wraps a runner and lets a test control its steps; everything else (``spec``,
    ``num_blocks``, ``save_kv``, ...) is the wrapped runner's.

    - The gate: open by default. ``close_gate()`` makes the next step wait inside ``execute``
      (the engine thread with it: commands such as admissions queue up meanwhile);
      ``allow_steps(n)`` lets ``n`` more steps through, then it is shut again;
      ``wait_until_blocked()`` returns once a step waits at the shut gate; ``open_gate()``.
      A step that waits longer than ``gate_timeout_s`` raises ``TimeoutError`` (a test that
      forgot to open the gate fails instead of hanging).
    - ``delay_s``: every step sleeps this long first (to catch a request mid-stream).
    - ``fail_step(after=k)``: the step after the next ``k`` ones raises ``RuntimeError``.

    ``num_steps`` counts the steps that got through the gate (failed ones included).
    """

    def __init__(self, inner, *, delay_s: float = 0.0, gate_timeout_s: float = 30.0) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.gate_timeout_s = gate_timeout_s
        self.num_steps = 0
        self._cond = threading.Condition()
        self._permits: int | None = None  # steps allowed before the gate shuts; None: open
        self._blocked = False  # a step waits at the shut gate
        self._failures: dict[int, str] = {}  # step number → message of the error it raises

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def execute(self, sched_out, *args, **kwargs):
        with self._cond:
            while self._permits == 0:
                self._blocked = True
                self._cond.notify_all()
                if not self._cond.wait(self.gate_timeout_s):
                    self._blocked = False
                    raise TimeoutError(f"the step gate stayed shut for {self.gate_timeout_s} s")
            self._blocked = False
            if self._permits is not None:
                self._permits -= 1
            self.num_steps += 1
            failure = self._failures.pop(self.num_steps, None)
        if self.delay_s:
            time.sleep(self.delay_s)
        if failure is not None:
            raise RuntimeError(failure)
        return self.inner.execute(sched_out, *args, **kwargs)

    # ---- the test's side --------------------------------------------------------------------

    def close_gate(self) -> None:
        with self._cond:
            self._permits = 0

    def allow_steps(self, num_steps: int) -> None:
        """Let ``num_steps`` more steps through the gate, then shut it."""
        with self._cond:
            self._permits = (self._permits or 0) + num_steps
            self._blocked = False  # the waiting step goes on; it sets this again if it waits
            self._cond.notify_all()

    def open_gate(self) -> None:
        with self._cond:
            self._permits = None
            self._blocked = False
            self._cond.notify_all()

    def wait_until_blocked(self, timeout_s: float = 5.0) -> bool:
        """True once a step waits at the shut gate (False: none did within ``timeout_s``)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._blocked, timeout_s)

    def fail_step(self, after: int = 0, message: str = "step failed on purpose") -> None:
        """Make the step after the next ``after`` steps raise ``RuntimeError(message)``."""
        with self._cond:
            self._failures[self.num_steps + after + 1] = message

    def reset(self) -> None:
        """Open the gate, no delay, no planned failures."""
        with self._cond:
            self.delay_s = 0.0
            self._failures.clear()
        self.open_gate()


def fake_engine(
    num_blocks: int = 64,
    block_size: int = 4,
    num_layers: int = 2,
    *,
    wrap_runner: Callable[[FakeModelRunner], ModelRunner] | None = None,
    **config,
) -> LLMEngine:
    """An engine over the fake runner: ``fake_engine(kv_host_memory="1MiB", ...)``. No tier is
    on unless asked for. ``wrap_runner`` (e.g. ``ControlledRunner``) wraps the fake runner
    before the engine is assembled around it: ``engine.runner`` is the wrapper."""
    config.setdefault("kv_host_memory", "off")
    config.setdefault("kv_disk_path", "off")
    config.setdefault("block_size", block_size)
    engine_config = EngineConfig.from_kwargs(**config)
    runner = FakeModelRunner(num_blocks, block_size, ByteTokenizer.vocab_size, num_layers)
    if wrap_runner is not None:
        runner = wrap_runner(runner)
    return assemble_engine(
        engine_config,
        runner,
        ByteTokenizer(),
        model_fingerprint="fake-model",
        max_model_len=config.get("max_model_len") or 2048,
    )


def run_all(engine, prompts, params, options=None) -> list:
    """Submit every prompt at once and step the engine until all finish; the final outputs,
    in prompt order."""
    ids = [engine.add_request(p, params, options) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]

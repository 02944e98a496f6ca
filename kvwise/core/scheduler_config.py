"""The scheduler's configuration: a frozen dataclass validated on construction (ValueError
naming the field). It lives in the core, beside the scheduler that reads it, so the core
imports no module above it; ``kvwise.config`` composes it into ``EngineConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from kvwise.utils import check_positive_int, check_positive_or_none


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # cap on running requests
    max_num_batched_tokens: int = 2048  # token budget of one step
    prefill_chunk_size: int | None = 512  # most prompt tokens of one request in one step
    max_waiting: int | None = None  # None: unbounded waiting queue
    # while others run, admit a request only when its whole prompt (and a block of its answer)
    # fits beside the rest of theirs; False: on its first chunk (more at once, preempted when
    # the pool runs out)
    admit_whole_prompts: bool = True
    # with whole-prompt admission, how many requests may be admitted ahead of a waiting one
    # that does not fit yet (then nothing behind it goes first: it is never starved); 0:
    # strict FIFO, a request that does not fit holds up every one behind it
    max_admission_skips: int = 32

    def __post_init__(self) -> None:
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive_or_none("prefill_chunk_size", self.prefill_chunk_size)
        check_positive_or_none("max_waiting", self.max_waiting)
        if (
            isinstance(self.max_admission_skips, bool)
            or not isinstance(self.max_admission_skips, int)
            or self.max_admission_skips < 0
        ):
            raise ValueError(
                "max_admission_skips: must be an integer >= 0 (0: strict FIFO admission), "
                f"got {self.max_admission_skips!r}"
            )
        if not isinstance(self.admit_whole_prompts, bool):
            raise ValueError(
                f"admit_whole_prompts: must be True or False, got {self.admit_whole_prompts!r}"
            )

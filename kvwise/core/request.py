"""The scheduler's view of one request: token ids, progress and status. Pure Python."""

from __future__ import annotations

import enum

from kvwise.core.hashing import BlockHash
from kvwise.types import FinishReason, RequestOptions, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to recompute
    FINISHED = "finished"


class Request:
    """A sequence being generated.

    ``token_ids`` is the prompt followed by the tokens generated so far;
    ``num_computed_tokens`` of them have K/V in the cache. The last token of a running request
    is never computed before it is scheduled, so ``num_computed_tokens < num_tokens`` whenever
    the request waits for a step.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        options: RequestOptions | None = None,
        arrival_time: float = 0.0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.options = options or RequestOptions()
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled: prefix tokens found cached
        self.num_tokens_projected = 0  # token positions whose K/V were computed (any layer)
        self.num_preemptions = 0
        self.num_admission_skips = 0  # requests admitted ahead of it while it could not fit
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []  # SamplingParams.logprobs
        # SamplingParams.prompt_logprobs: position -> (logprob, top k), positions 1..
        self.prompt_logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        self.block_hashes: list[BlockHash] = []  # hashes of the full blocks of token_ids
        self.group_hashes: list[list[BlockHash]] = []  # hybrid KV groups 1..: theirs
        self.num_public_blocks: int | None = None  # leading blocks hashed as a public prefix
        self.num_loaded_tokens = 0  # prefix tokens loaded from the slower tiers
        # cache breakpoints (core/breakpoints.py): its KeepRuns, set at its first lookup; the
        # most leading blocks a hit may cover (a breakpoint's keep ran out past them)
        self.keep_runs: tuple | None = None
        self.hit_limit_blocks: int | None = None
        # structured outputs: the engine's matcher (engine/structured.Grammar: bitmask(),
        # accept(token), finished), opaque here
        self.grammar = None
        # the parts of its stop policy the engine attached (core/stopping.StopPart: its
        # grammar, its stop strings), told every sampled token; why it failed, if it did
        self.stop_parts: list = []
        self.error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def tenant(self) -> str:
        return self.options.tenant

    @property
    def cache_salt(self) -> str | None:
        return self.options.cache_salt

    @property
    def retention_s(self) -> float | None:
        """Keep this request's cached blocks this long (None: plain LRU)."""
        return self.options.retention_s

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, logprob: float) -> None:
        """Add a sampled token (whether it ends the request: ``core/stopping.stop_reason``)."""
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )

"""Plain data crossing the scheduler ↔ worker boundary: ints, strings, frozen params and, for
the tiers, the planned chunks to load into device blocks and to copy out of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwise.core.kv_tiers import ChunkWrite, PlannedChunk
from kvwise.types import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    The worker computes K/V for ``token_ids`` at positions ``start_pos ..
    start_pos + len(token_ids) - 1``, writes them into ``block_ids`` and attends over the
    whole context. When ``sample`` is true the chunk reaches the end of the sequence and one
    new token is drawn from the last position's logits.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    output_index: int  # index of the token to sample among the outputs (for seeded draws)
    # hybrid KV groups 1.. (``core/kv_spec.kv_groups``): their block tables; block_ids is
    # group 0's. Empty: one table for every layer
    group_block_ids: tuple[list[int], ...] = ()
    # the request's token ids (prompt then output), where sampling reads them: a penalty, or
    # prompt logprobs (the targets of this chunk's rows); None otherwise
    history: list[int] | None = None
    num_prompt_tokens: int = 0
    # 1: the pool holds this chunk's first row's K/V already (a prompt cached whole, its last
    # token computed for its logits): the row attends but is not written
    kv_in_pool: int = 0
    # a block-aligned prompt's key (its last block's hash, which descends from its namespace's
    # root) on the chunk that ends at the prompt's end: the runner may keep that last row's
    # final hidden state under it, and a whole hit (``kv_in_pool``) with the same key may
    # sample from the kept state instead of computing the row again (the same bits: a row's
    # result does not depend on its batch, chunk or step)
    last_row_key: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class KVLoad:
    """A run of stored blocks to stream into fresh device blocks while the step runs (each
    layer group before the model reaches it)."""

    request_id: str
    block_ids: list[int]  # device blocks receiving the chunk's blocks, in order
    chunk: PlannedChunk


@dataclass(frozen=True)
class KVSave:
    """Copy device blocks out for the tiers before another step runs (they may be reused)."""

    block_ids: list[int]
    chunk: ChunkWrite
    ttl_s: float | None
    tenant: str | None = None  # whose retention ``ttl_s`` is (tiers cap it per tenant)
    soon: bool = False  # its request was preempted and will be back: written without delay


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)  # copy in before the step runs
    # blocks freed before being cached (open tails): the worker drops what it kept for them
    released_block_ids: list[int] = field(default_factory=list)
    # structured outputs: the tokens each sampling request's grammar allows now, a bitmask of
    # little-endian 32-bit words (bit i of word w: token 32 w + i), set by the engine
    token_bitmasks: dict[str, bytes] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelOutput:
    """Sampled token id and its logprob for each request whose chunk asked to sample."""

    sampled: dict[str, tuple[int, float]] = field(default_factory=dict)
    # SamplingParams.logprobs k > 0: the sampled row's k most likely (token id, logprob)
    top_logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: (position, logprob of the prompt token there, top k)
    # for each prompt position this step's rows predict
    prompt_logprobs: dict[str, list[tuple[int, float, list[tuple[int, float]]]]] = field(
        default_factory=dict
    )
    # whole hits sampled from a kept last row (``ScheduledRequest.last_row_key``), not computed
    last_rows_reused: int = 0
    # rows whose sampling failed (request id → why): not in ``sampled``; the engine ends
    # those requests alone (FinishReason.ERROR) and the step's other rows go on
    failed: dict[str, str] = field(default_factory=dict)

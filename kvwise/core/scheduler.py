"""Token-budget scheduler: no prefill/decode phases, just a budget of tokens per step.

Each step: running requests first (decodes and unfinished prefill chunks, in admission order),
then waiting ones in FIFO order while the budget, the ``max_num_seqs`` cap and the pool
allow; while others run, each only once the free blocks hold its whole prompt beside the
rest of theirs (and a block of each answer). One that does not fit yet does not block those
behind it until it has been skipped ``max_admission_skips`` times (``core/admission.py``). A
long prompt is cut into chunks of at most ``prefill_chunk_size`` tokens, so it never stalls the
others' decoding. When blocks run out (answers outgrowing the pool), the newest running
request is preempted: its blocks are freed and it goes back to the head of the queue to be
recomputed.

With tiers below the pool (a ``KVTierPlanner``, see ``core/kv_tiers.py``), admission continues
a device prefix hit from the slower tiers when the tiers' plan says loading beats recomputing
(``SchedulerOutput.kv_loads``); a load that comes up short is rolled back (``update``); and
the full blocks of every finished or preempted request are handed out as ``KVSave`` items
(``take_saves``), which the engine copies out before the next step can reuse the blocks. The
plans, loads, rollbacks and saves are the ``TierCoordinator``'s (``core/tier_coordinator.py``):
the scheduler says when.

With ``enable_kv_cache=False`` every step recomputes each request's whole sequence (the seed
article's "no cache" baseline): after each step the computed count is reset to zero.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvwise.core.admission import WaitingScan
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.kv_tiers import KVTierPlanner
from kvwise.core.outputs import KVSave, ModelOutput, ScheduledRequest, SchedulerOutput
from kvwise.core.request import Request, RequestStatus
from kvwise.core.scheduler_config import SchedulerConfig
from kvwise.core.shared_prefill import shared_prefill
from kvwise.core.stopping import stop_reason
from kvwise.core.tier_coordinator import TierCoordinator
from kvwise.errors import ContextLengthExceeded, InvalidRequest, QueueFullError
from kvwise.types import FinishReason


@dataclass
class RequestUpdate:
    """What one step did to one request, for the engine to turn into outputs."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        enable_kv_cache: bool = True,
        tiers: KVTierPlanner | None = None,
    ) -> None:
        self.config = config
        step = config.max_num_batched_tokens  # (the most prompt tokens of one step: a chunk)
        self._chunk = min(config.prefill_chunk_size or step, step)
        self.tiers = tiers if kv_manager.enable_caching else None
        self.tier_coordinator = TierCoordinator(self.tiers, kv_manager)
        self.kv = kv_manager
        self._windowed = any(kv_manager.windows)  # the tiers get windowed groups' prompts
        self.max_model_len = max_model_len
        self.enable_kv_cache = enable_kv_cache
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefill_waits = 0  # admissions put off a step: their prompt was being computed
        self.num_admission_skips = 0  # admissions past a waiting request that did not fit
        self.num_admission_aged = 0  # requests skipped max_admission_skips times (then FIFO)
        self._finished_while_scheduling: list[Request] = []  # reported by the next update()

    # ---- admission ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            InvalidRequest: the id is in use; ContextLengthExceeded: the prompt could never
                run; QueueFullError: the bounded waiting queue is full.
        """
        if request.request_id in self.requests:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already in use")
        if request.num_tokens >= self.max_model_len:
            raise ContextLengthExceeded(
                "prompt",
                f"{request.num_tokens} tokens do not fit the model's context of "
                f"{self.max_model_len} tokens (at least one must be left to generate)",
            )
        need = self.kv.blocks_for(request.num_tokens + 1, self._chunk)  # computed in chunks
        if need > self.kv.num_blocks:
            raise ContextLengthExceeded(
                "prompt",
                f"{request.num_tokens} tokens do not fit the KV cache of "
                f"{self.kv.num_blocks} blocks of {self.kv.block_size} tokens (they need "
                f"{need}); raise kv_cache_memory",
            )
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError()
        request.max_model_len = self.max_model_len
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> None:
        """Finish (abort, or stop on a stop string) requests and free their blocks at once."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.tier_coordinator.plan_saves(request)
        self.kv.free(request)
        self.tier_coordinator.forget(request.request_id)
        del self.requests[request.request_id]

    @property
    def num_load_rollbacks(self) -> int:
        return self.tier_coordinator.num_load_rollbacks

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step -----------------------------------------------------------------------

    def _num_new_tokens(self, request: Request, budget: int, computed: int | None = None) -> int:
        """Tokens to compute for ``request`` this step (``computed``: its computed tokens, when
        they are not ``num_computed_tokens`` yet: at admission)."""
        if computed is None:
            computed = request.num_computed_tokens
        num_new = request.num_tokens - computed
        if num_new > 1 and self.config.prefill_chunk_size is not None:
            num_new = min(num_new, self.config.prefill_chunk_size)
        return min(num_new, budget)

    def load_tokens(self) -> tuple[int, int]:
        """``(queued, running)`` tokens, what a router weighs against a cache hit: prompt tokens
        still to compute (waiting requests past the prefix their pool holds, unfinished
        prefills), and the context of every running request."""
        queued = sum(
            r.num_tokens - max(r.num_computed_tokens, self.kv.cached_prefix_tokens(r))
            for r in self.waiting
        )
        queued += sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in self.running)
        return queued, sum(r.num_tokens for r in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(released_block_ids=self.kv.take_released())
        self.tier_coordinator.begin_step()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int, list[list[int]], int]] = []
        budget = self._schedule_running(out, scheduled, budget)
        if not out.preempted_ids:  # (the pool is full: do not admit while evicting)
            self._schedule_waiting(out, scheduled, budget)
        for request, num_new, tables, in_pool in scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            out.scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.token_ids[start:end],
                    start_pos=start,
                    block_ids=tables[0],
                    group_block_ids=tuple(tables[1:]),
                    sample=end == request.num_tokens,
                    sampling_params=request.sampling_params,
                    output_index=request.num_output_tokens,
                    history=request.token_ids if _reads_history(request) else None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    kv_in_pool=in_pool,
                    last_row_key=self.kv.last_row_key(request, end),
                )
            )
        return out

    def _schedule_waiting(self, out: SchedulerOutput, scheduled: list, budget: int) -> None:
        """Admit waiting requests in FIFO order while the budget, ``max_num_seqs`` and the
        pool allow, looking past one that does not fit yet until it has aged
        (``core/admission.py``; only with whole-prompt admission: on its first chunk, what
        does not fit is the pool's last blocks)."""
        skips = self.config.max_admission_skips if self.config.admit_whole_prompts else 0
        scan = WaitingScan(self.waiting, skips)
        committed = None  # blocks the running requests will still take (summed once)
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = scan.next()
            if request is None:
                break
            if self.kv.enable_caching and shared_prefill(request, self.running, self.kv.hashes):
                self.num_prefill_waits += 1
                break  # its prompt is being computed now: one prefill, then a prefix hit
            if committed is None and self.running and self.config.admit_whole_prompts:
                committed = sum(self.kv.blocks_to_come(r, self._chunk) for r in self.running)
            looked_up = self.kv.num_prefix_query_tokens, self.kv.num_prefix_hit_tokens
            admitted = self._admit(request, out, budget, committed)
            if admitted is None:  # its lookup is counted when it is admitted, not every try
                self.kv.num_prefix_query_tokens, self.kv.num_prefix_hit_tokens = looked_up
                if scan.blocked(request):
                    continue
                break
            if admitted:
                scan.admitted()
                scheduled.append(admitted)
                budget -= admitted[1]
                if committed is not None:
                    committed += self.kv.blocks_to_come(admitted[0], self._chunk)
        self.num_admission_skips += scan.num_skips
        self.num_admission_aged += scan.num_aged

    def _schedule_running(self, out: SchedulerOutput, scheduled: list, budget: int) -> int:
        """Give every running request its next tokens, preempting the newest on a block
        shortage. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            while True:
                block_ids = self.kv.allocate_slots(request, num_new)
                if block_ids is not None:
                    break
                if len(self.running) == 1:
                    break  # alone and still out of blocks: it has outgrown the pool
                victim = self.running[-1]  # the newest running request
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            if block_ids is None:
                if request.status is RequestStatus.RUNNING:
                    self.running.remove(request)
                    self._finish(request, FinishReason.LENGTH)
                    self._finished_while_scheduling.append(request)
                break  # nothing after it is running
            scheduled.append((request, num_new, block_ids, 0))
            budget -= num_new
            i += 1
        return budget

    def _admit(self, request: Request, out: SchedulerOutput, budget: int, committed: int | None):
        """Admit a waiting request: its cached prefix, any load from the tiers,
        and blocks for its first chunk. Returns ``(request, num_new, tables, kv_in_pool)``,
        ``()`` when it finished instead (it can never fit), or None when it must wait for
        blocks.

        Past what the running ones have ``committed`` to take (None: no check), the free blocks
        must hold its whole prompt and a block of its answer, or it would soon be preempted."""
        computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        bs = self.kv.block_size
        # a whole hit: the pool holds the last token's K/V too; it is computed (for its
        # logits) and not written
        in_pool = 1 if num_cached == request.num_tokens else 0
        num_cached -= in_pool
        num_device = num_cached // bs
        loads = [] if in_pool else self.tier_coordinator.plan_load(request, num_device)
        room = None if committed is None else self.kv.pool.num_free_blocks - committed
        if (
            room is not None
            and self.kv.blocks_to_come(request, self._chunk, computed_blocks) > room
        ):
            return None
        # loaded: the tokens after the device hit up to the end of group 0's load (a windowed
        # group's table holds the null block before its window's first loaded block)
        num_loaded = (loads[0][2] + loads[0][1].num_blocks - num_device) * bs if loads else 0
        num_new = self._num_new_tokens(request, budget, num_cached + num_loaded)
        tables = self.kv.allocate_slots(
            request, num_loaded + num_new - in_pool, computed_blocks, num_loaded_tokens=num_loaded
        )
        if tables is None:
            if self.running:
                return None
            # alone and still too big: it grew past the pool while generating
            self.waiting.remove(request)
            self._finish(request, FinishReason.LENGTH)
            self._finished_while_scheduling.append(request)
            return ()
        self.waiting.remove(request)
        self.tier_coordinator.admitted(request, num_device, loads, tables, out)
        request.num_loaded_tokens += num_loaded
        num_cached += num_loaded
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request, num_new, tables, in_pool

    def take_saves(self) -> list[KVSave]:
        """Blocks to copy out for the tiers; copy them before the next step runs."""
        return self.tier_coordinator.take_saves()

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.tier_coordinator.plan_saves(request, soon=True)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(
        self,
        sched_out: SchedulerOutput,
        model_out: ModelOutput,
        short_loads: dict[str, int] | None = None,
    ) -> list[RequestUpdate]:
        """Advance every scheduled request by what the worker computed and sampled.

        ``short_loads``: requests whose planned loads came up short, with the number of
        blocks that did arrive (verified); they are rolled back instead of advanced.
        """
        short_loads = short_loads or {}
        updates = [RequestUpdate(r, [], True) for r in self._finished_while_scheduling]
        self._finished_while_scheduling = []
        for item in sched_out.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_tokens_projected += item.num_tokens
            if item.request_id in short_loads:
                self.tier_coordinator.roll_back(request, item, short_loads[item.request_id])
                continue
            request.num_computed_tokens += item.num_tokens
            self.kv.cache_full_blocks(request)
            for pos, logprob, top in model_out.prompt_logprobs.get(item.request_id, ()):
                request.prompt_logprobs[pos] = (logprob, top)
            if not item.sample:
                continue
            if self._windowed and not request.num_output_tokens:
                self.tier_coordinator.plan_saves(request, windowed_only=True)  # its prompt is done
            token_id, logprob = model_out.sampled[item.request_id]
            request.append_token(token_id, logprob)
            if request.sampling_params.logprobs is not None:
                request.output_top_logprobs.append(model_out.top_logprobs.get(item.request_id, []))
            reason = stop_reason(request, token_id)  # the one place a request's end is decided
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
            elif not self.enable_kv_cache:
                request.num_computed_tokens = 0  # recompute everything next step
            updates.append(RequestUpdate(request, [token_id], reason is not None))
        return updates


def _reads_history(request: Request) -> bool:
    """Sampling reads the request's tokens: a penalty, or its prompt's logprobs."""
    params = request.sampling_params
    return params.penalized or params.prompt_logprobs is not None

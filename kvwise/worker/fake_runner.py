"""A model-free runner for tests of the scheduler and engine. No torch.

It keeps token ids in its "KV slots" and derives the next token from the context it reads
back through the block tables, so a wrong block table or slot mapping changes its output just
as it would a real model's.
"""

from __future__ import annotations

import hashlib

from kvwise.core.outputs import ModelOutput, SchedulerOutput


class FakeModelRunner:
    """A model-free runner whose next token is a hash of the whole context read from slots."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.num_tokens_computed = 0

    def execute(self, sched_out: SchedulerOutput) -> ModelOutput:
        out = ModelOutput()
        bs = self.block_size
        for item in sched_out.scheduled:
            for i, token_id in enumerate(item.token_ids):
                pos = item.start_pos + i
                self.slots[item.block_ids[pos // bs] * bs + pos % bs] = token_id
            self.num_tokens_computed += item.num_tokens
            if not item.sample:
                continue
            ctx_len = item.start_pos + item.num_tokens
            context = [self.slots[item.block_ids[p // bs] * bs + p % bs] for p in range(ctx_len)]
            digest = hashlib.sha256(repr(context).encode()).digest()
            out.sampled[item.request_id] = (
                int.from_bytes(digest[:4], "little") % self.vocab_size,
                0.0,
            )
        return out

"""The final hidden states of block-aligned prompts' last rows, kept for whole hits.

A prompt that the pool holds whole still needs its last row's logits for its first token.
The runner computes that row once, with the prompt (``ScheduledRequest.last_row_key``), and
keeps its final-normed hidden state here, under the prompt's last block hash: a later whole
hit of the same prompt samples from the kept state instead of running the model for one row.
The kept state holds the same bits as the row computed again (a row's result does not depend
on its batch, chunk or step, which tests/model/test_batch_invariance.py checks), so the answer
is the same either way. The key descends from the prompt's namespace root, so a state is
found only where the prompt's own KV blocks would be.

Least recently used first out, within ``max_bytes`` (0: nothing is kept).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

LAST_ROWS_BYTES = 16 << 20  # ~7,000 rows of a 576-wide model, ~2,000 of a 2,048-wide one


class LastRows:
    def __init__(self, max_bytes: int = LAST_ROWS_BYTES):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: bytes | None) -> torch.Tensor | None:
        row = None if key is None else self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
        return row

    def put(self, key: bytes, row: torch.Tensor) -> None:
        """Keep a copy of ``row`` (one hidden state) under ``key``."""
        size = row.numel() * row.element_size()
        if size > self.max_bytes or key in self._rows:
            return
        self._rows[key] = row.detach().clone()
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self._rows.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()

"""Sampling: a pure function from logits and per-request parameters to token ids, their
logprobs and, where asked, the most likely tokens' logprobs.

Before the draw, each row's logits are changed by what its request asks (``SamplingParams``:
logit bias, repetition, presence and frequency penalties) and by its grammar's token mask
(``bitmask``: tokens outside it cannot be drawn). Greedy rows then take the argmax. Other rows
apply temperature, then top-k, top-p and min-p filters, then draw. A request with a seed draws
its i-th output token from a generator seeded with (seed, i) alone, so the draw does not depend
on batching or preemption.

Every logprob returned is of the model's unmodified distribution (log-softmax of the raw
logits), the chosen token's and the top ones' alike. A step of greedy rows with nothing to
change and no top logprobs to report takes the argmax and its logprob in one C++ pass a row.

A row fails alone: its processed and filtered logits are kept finite (+inf and nan become the
largest float and -inf), and a row whose draw still fails (no finite probability, or anything
raised while processing or drawing it) is reported in ``Sampled.errors`` with token id 0; the
other rows' tokens are what they would be without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvwise import kernels
from kvwise.models.linear import mask_logits
from kvwise.types import SamplingParams

_SEED_STRIDE = 1_000_003
_SEED_RANGE = 2**63  # manual_seed takes a signed 64-bit value
_MIN_TEMPERATURE = 1e-5  # below this, sampling is treated as greedy
_FLOAT_MAX = torch.finfo(torch.float32).max


def finite_(row: torch.Tensor) -> torch.Tensor:
    """+inf → the largest float, nan → -inf (never drawn), in place; -inf stays."""
    return torch.nan_to_num_(row, nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))


@dataclass
class Sampled:
    """One token a row: its id, its logprob and (``logprobs`` asked) the top tokens'."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]] | None]
    errors: dict[int, str] = field(default_factory=dict)  # row → why its sampling failed


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row ``(V,)``; returns filtered logits."""
    logits = finite_(logits / params.temperature)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return finite_(logits)


def process_row(
    row: torch.Tensor,  # (V,) float32, changed in place
    params: SamplingParams,
    history: tuple[Sequence[int], int] | None = None,
) -> None:
    """Logit bias, then the repetition penalty (over prompt and output), then the presence
    and frequency penalties (over the output); ``history``: (the request's token ids, how many
    of them are the prompt)."""
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        row.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias]))
    if history is None or not params.penalized:
        return
    token_ids, num_prompt = history
    if params.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        values = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    outputs = token_ids[num_prompt:]
    if (params.presence_penalty or params.frequency_penalty) and outputs:
        ids, counts = torch.unique(
            torch.tensor(list(outputs), dtype=torch.long), return_counts=True
        )
        row[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty


def sample(
    logits: torch.Tensor,  # (S, V) float32
    params: list[SamplingParams],
    output_indices: list[int],
    histories: Sequence[tuple[Sequence[int], int] | None] | None = None,
    bitmask: torch.Tensor | None = None,
) -> Sampled:
    """Pick one token per row. ``histories[row]``: (token ids, prompt length) of a request
    with a penalty; ``bitmask``: the rows' grammar masks ``(S, W)`` (``bitmask_words``)."""
    num_rows = len(params)
    histories = histories or [None] * num_rows
    plain = all(
        p.temperature < _MIN_TEMPERATURE and not p.processed and p.logprobs is None for p in params
    )
    if plain and kernels.runs_on(logits):
        # all greedy: the argmax and its logprob in one C++ pass a row (no (S, V) log-softmax)
        if bitmask is None:
            ids, chosen = torch.ops.kvwise.greedy_pick(logits.float().contiguous())
            return Sampled(ids.tolist(), chosen.tolist(), [None] * num_rows)
        raw = logits.float()
        ids, _ = torch.ops.kvwise.greedy_pick(mask_logits(raw, bitmask))  # the best allowed
        chosen = raw.gather(1, ids.unsqueeze(1)).squeeze(1) - torch.logsumexp(raw, dim=-1)
        return Sampled(ids.tolist(), chosen.tolist(), [None] * num_rows)
    raw = logits.float()
    logprobs = torch.log_softmax(raw, dim=-1)  # (S, V)
    work = raw if bitmask is None else mask_logits(raw, bitmask)
    if any(p.processed for p in params):
        work = work.clone() if work is raw else work
    token_ids = torch.argmax(work, dim=-1)  # (S,); greedy rows processed below are redone
    errors: dict[int, str] = {}
    for row, p in enumerate(params):
        if not p.processed and p.temperature < _MIN_TEMPERATURE:
            continue
        try:
            token_ids[row] = _pick_row(work[row], p, histories[row], output_indices[row])
        except Exception as exc:  # noqa: BLE001 - this row fails alone
            errors[row] = f"sampling failed: {exc}"
            token_ids[row] = 0
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # (S,)
    top = [
        top_logprobs(logprobs[row : row + 1], p.logprobs)[0] if p.logprobs else None
        for row, p in enumerate(params)
    ]
    return Sampled(token_ids.tolist(), chosen.tolist(), top, errors)


def _pick_row(row: torch.Tensor, p: SamplingParams, history, output_index: int) -> int:
    """One row's token: processed (in place), then its argmax (greedy) or a draw."""
    if p.processed:
        process_row(row, p, history)
        finite_(row)
    if p.temperature < _MIN_TEMPERATURE:
        return int(torch.argmax(row))  # a vanishing temperature would only overflow the softmax
    probs = apply_filters(row, p).softmax(-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise FloatingPointError("the row's probabilities are not finite")
    generator = None
    if p.seed is not None:
        seed = (p.seed * _SEED_STRIDE + output_index) % _SEED_RANGE
        generator = torch.Generator().manual_seed(seed)
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def top_logprobs(rows: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each logprob row's ``k`` most likely tokens, best first (one top-k for all rows)."""
    values, ids = torch.topk(rows, min(k, rows.shape[-1]), dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist())]


def bitmask_words(requests, bitmasks: dict[str, bytes], vocab_size: int) -> torch.Tensor | None:
    """The sampling requests' grammar masks as one ``(S, W)`` int32 tensor (llguidance's
    layout: bit i of word w allows token 32 w + i; a row without a grammar allows every
    token), or None when no request has one."""
    if not bitmasks:
        return None
    width = -(-vocab_size // 32)
    everything = b"\xff" * (4 * width)
    rows = []
    for r in requests:
        words = bitmasks.get(r.request_id, everything)
        rows.append(words[: 4 * width].ljust(4 * width, b"\x00"))
    return torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.int32).view(len(rows), width)

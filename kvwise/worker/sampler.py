"""Sampling: a pure function from logits and per-request parameters to (token id, logprob).

Greedy rows take the argmax. Other rows apply temperature, then top-k, top-p and min-p
filters, then draw. A request with a seed draws its i-th output token from a generator seeded
with (seed, i) alone, so the draw does not depend on batching or preemption.

The returned logprob is that of the chosen token under the model's unmodified distribution
(log-softmax of the raw logits).
"""

from __future__ import annotations

import torch

from kvwise import kernels
from kvwise.types import SamplingParams

_SEED_STRIDE = 1_000_003
_SEED_RANGE = 2**63  # manual_seed takes a signed 64-bit value
_MIN_TEMPERATURE = 1e-5  # below this, sampling is treated as greedy


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row ``(V,)``; returns filtered logits."""
    logits = logits / params.temperature
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
    return logits


def sample(
    logits: torch.Tensor,  # (S, V) float32
    params: list[SamplingParams],
    output_indices: list[int],
) -> tuple[list[int], list[float]]:
    """Pick one token per row; return the token ids and their logprobs."""
    if all(p.temperature < _MIN_TEMPERATURE for p in params) and kernels.available():
        # all greedy: the argmax and its logprob in one C++ pass a row (no (S, V) log-softmax)
        ids, chosen = torch.ops.kvwise.greedy_pick(logits.float().contiguous())
        return ids.tolist(), chosen.tolist()
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (S, V)
    token_ids = torch.argmax(logits, dim=-1)  # (S,)
    for row, p in enumerate(params):
        if p.temperature < _MIN_TEMPERATURE:
            continue  # greedy; a vanishing temperature would only overflow the softmax
        filtered = apply_filters(logits[row].float(), p)
        probs = filtered.softmax(-1)
        generator = None
        if p.seed is not None:
            seed = (p.seed * _SEED_STRIDE + output_indices[row]) % _SEED_RANGE
            generator = torch.Generator().manual_seed(seed)
        token_ids[row] = torch.multinomial(probs, 1, generator=generator)[0]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # (S,)
    return token_ids.tolist(), chosen.tolist()

"""When does loading a stored prefix beat recomputing it? Pure Python.

Two kinds of prediction, both fitted online from what the engine measures, each started from
a prior so the first decisions are sensible:

- ``t_recompute``: a step of the model costs ``γ + α·T + β·A`` seconds, where ``T`` is the
  number of tokens in the step and ``A = Σ (end² − start²) / 2`` over its chunks (attention
  work grows with the context each token attends to). Recomputing tokens ``[a, b)`` of a
  prompt is the sum of that over the prefill chunks it would take.
- ``t_load(tier)``: one batched read of ``n`` entries of ``B`` bytes (read + check) costs
  ``λ + μ·n + B/bandwidth``, per tier; copying ``B`` bytes into the device pool costs
  ``κ + B/copy_bandwidth``.

``choose`` compares, for every number of stored chunks one could load, the load time plus
the recompute time of what is left, and picks the cheapest. A decision is kept as a
``LoadDecision`` so it can be checked against what was measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# priors (seconds, in the scaled units below) for SmolLM2-135M-class models on a 2-core CPU;
# live measurements take over within a few dozen observations
_STEP_PRIOR = (0.03, 1.6, 0.25)  # γ, α per 1e3 tokens, β per 1e6 token·context
# a tier's read time: λ + μ per entry + seconds per GB; each tier class states its own prior
# (``load_prior``); one that states none is assumed slow until measured
DEFAULT_TIER_PRIOR = (5e-4, 2e-4, 2.0)
_COPY_PRIOR = (1e-4, 0.4)


class OnlineFit:
    """Least squares over a few features, updated one observation at a time (recursive
    least squares with exponential forgetting), starting from prior weights."""

    def __init__(self, prior: Sequence[float], prior_var: float = 1.0, forget: float = 0.98):
        n = len(prior)
        self.w = list(prior)
        self.P = [[prior_var if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.forget = forget
        self.num_updates = 0

    def predict(self, x: Sequence[float]) -> float:
        return max(0.0, sum(wi * xi for wi, xi in zip(self.w, x)))

    def update(self, x: Sequence[float], y: float) -> None:
        n, lam = len(self.w), self.forget
        px = [sum(self.P[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        k = [p / denom for p in px]
        err = y - sum(wi * xi for wi, xi in zip(self.w, x))
        self.w = [wi + ki * err for wi, ki in zip(self.w, k)]
        self.P = [[(self.P[i][j] - k[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        self.num_updates += 1


@dataclass(frozen=True)
class LoadDecision:
    """One choice between loading and recomputing a stored prefix."""

    request_id: str
    start_tokens: int  # tokens already in the device pool
    available_tokens: int  # further prefix tokens the tiers hold
    chosen_tokens: int  # of those, how many were chosen to load
    tiers: tuple[str, ...]  # tier of each available chunk, in order
    predicted_load_s: float  # for the chosen tokens (0 when none)
    predicted_recompute_s: float  # recomputing the chosen tokens instead (or all available)

    @property
    def recomputed_instead(self) -> bool:
        return self.chosen_tokens < self.available_tokens


class CostModel:
    """Args:
    prefill_chunk_size: the scheduler's, for recompute estimates.
    tier_priors: ``{tier name: (λ, μ, seconds per GB)}`` to start each tier's read fit from
        (a tier not named starts from ``DEFAULT_TIER_PRIOR``).
    """

    def __init__(
        self,
        prefill_chunk_size: int | None = 512,
        tier_priors: dict[str, Sequence[float]] | None = None,
    ) -> None:
        self.prefill_chunk_size = prefill_chunk_size
        self.step = OnlineFit(_STEP_PRIOR, prior_var=0.5, forget=0.995)
        self.tier_priors = dict(tier_priors or {})
        self.tiers: dict[str, OnlineFit] = {}  # a tier's fit, made when first used
        self.copy = OnlineFit(_COPY_PRIOR, prior_var=1.0)

    def tier_fit(self, tier: str) -> OnlineFit:
        """The read-time fit of one tier (made from its prior when first asked for)."""
        fit = self.tiers.get(tier)
        if fit is None:
            prior = self.tier_priors.get(tier, DEFAULT_TIER_PRIOR)
            fit = self.tiers[tier] = OnlineFit(prior, prior_var=1.0)
        return fit

    # ---- observations -------------------------------------------------------------------

    def observe_step(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """A model step ran over chunks ``[(start_pos, num_tokens), ...]`` in ``seconds``."""
        # NOTE: decode steps count too: they pin down the fixed cost of a step (γ), which
        # decides short prefixes; long prefill chunks pin down α and β.
        if chunks:
            self.step.update(_step_features(chunks), seconds)

    def observe_load(self, tier: str, num_entries: int, num_bytes: int, seconds: float) -> None:
        self.tier_fit(tier).update((1.0, num_entries, num_bytes / 1e9), seconds)

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        self.copy.update((1.0, num_bytes / 1e9), seconds)

    # ---- predictions --------------------------------------------------------------------

    def t_recompute(self, start: int, end: int) -> float:
        """Seconds to prefill tokens ``[start, end)`` of one sequence, in chunks."""
        if end <= start:
            return 0.0
        size = self.prefill_chunk_size or (end - start)
        total = 0.0
        for s in range(start, end, size):
            total += self.step.predict(_step_features([(s, min(size, end - s))]))
        return total

    def t_load(self, reads: dict[str, tuple[int, int]], copy_bytes: int) -> float:
        """Seconds to read ``{tier: (num_entries, num_bytes)}`` and copy ``copy_bytes`` in."""
        total = sum(
            self.tier_fit(tier).predict((1.0, n, b / 1e9)) for tier, (n, b) in reads.items() if n
        )
        return total + (self.copy.predict((1.0, copy_bytes / 1e9)) if copy_bytes else 0.0)

    def choose(
        self,
        start_tokens: int,
        chunk_ends: Sequence[int],
        chunk_tiers: Sequence[str],
        entry_bytes: Sequence[int],
        block_bytes_per_token: float,
        num_prompt_tokens: int,
        entries_per_chunk: int = 1,
        extra: Callable[[int], tuple[int, int]] | None = None,
    ) -> tuple[int, float, float]:
        """How many of the available chunks to load.

        Args:
            start_tokens: prefix tokens already on the device.
            chunk_ends: token position where each available chunk's usable part ends.
            chunk_tiers: the tier each chunk would be read from.
            entry_bytes: bytes read for each chunk (whole entries).
            block_bytes_per_token: device bytes per token (for the copy).
            num_prompt_tokens: the prompt's length (the last token is always computed).
            entries_per_chunk: entries read per chunk (its layer groups).
            extra: ``extra(end) -> (entries, bytes)`` read (and copied) on top for a load
                ending at token ``end``: a hybrid model's other KV groups (read from the
                same tier as the chunk that ends there).

        Returns:
            (number of chunks, predicted load seconds, predicted recompute seconds of the
            same tokens).
        """
        best = (self.t_recompute(start_tokens, num_prompt_tokens), 0, 0.0, 0.0)
        reads: dict[str, tuple[int, int]] = {}
        for m, (end, tier, nbytes) in enumerate(zip(chunk_ends, chunk_tiers, entry_bytes), 1):
            n, b = reads.get(tier, (0, 0))
            reads[tier] = (n + entries_per_chunk, b + nbytes)
            copy = int((end - start_tokens) * block_bytes_per_token)
            if extra is None:
                t_load = self.t_load(reads, copy)
            else:
                xn, xb = extra(end)
                n, b = reads[tier]
                t_load = self.t_load({**reads, tier: (n + xn, b + xb)}, copy + xb)
            total = t_load + self.t_recompute(end, num_prompt_tokens)
            if total < best[0]:
                best = (total, m, t_load, self.t_recompute(start_tokens, end))
        if best[1] == 0 and chunk_ends:
            return 0, 0.0, self.t_recompute(start_tokens, chunk_ends[-1])
        return best[1], best[2], best[3]

    # ---- curves (read-only: any thread may ask, e.g. the server's dashboard) -------------

    def predict_load(self, tier: str, num_entries: int, num_bytes: int, copy_bytes: int) -> float:
        """Seconds to read ``num_entries`` entries (``num_bytes`` in all) from ``tier`` and
        copy ``copy_bytes`` into the pool: ``t_load`` for one tier, without making the
        tier's fit when it has none yet (its prior answers), so a thread other than the
        engine's may call it."""
        fit = self.tiers.get(tier) or OnlineFit(self.tier_priors.get(tier, DEFAULT_TIER_PRIOR))
        read = fit.predict((1.0, num_entries, num_bytes / 1e9)) if num_entries else 0.0
        return read + (self.copy.predict((1.0, copy_bytes / 1e9)) if copy_bytes else 0.0)

    def recompute_curve(self, num_tokens: Sequence[int]) -> list[float]:
        """``t_recompute(0, n)`` for each ``n``, with one prediction per prefill chunk of the
        longest plus one per ``n``."""
        if not num_tokens:
            return []
        size = self.prefill_chunk_size or max(1, *num_tokens)
        full = [0.0]  # full[k]: seconds for the first k whole chunks
        for k in range(max(num_tokens) // size):
            full.append(full[-1] + self.step.predict(_step_features([(k * size, size)])))
        out = []
        for n in num_tokens:
            k, rest = divmod(max(0, n), size)
            tail = self.step.predict(_step_features([(k * size, rest)])) if rest else 0.0
            out.append(full[k] + tail)
        return out

    def num_updates(self) -> dict[str, int]:
        """Observations each fit has taken (``step``, ``copy``, ``tier_<name>``)."""
        out = {"step": self.step.num_updates, "copy": self.copy.num_updates}
        out.update({f"tier_{k}": v.num_updates for k, v in dict(self.tiers).items()})
        return out

    def snapshot(self) -> dict[str, list[float]]:
        """Current fitted weights (for stats and the benchmark report)."""
        out = {"step": list(self.step.w), "copy": list(self.copy.w)}
        out.update({f"tier_{k}": list(v.w) for k, v in self.tiers.items()})
        return out


@dataclass(frozen=True)
class TierCurve:
    """One tier's predicted TTFT along ``CostCurves.prefix_tokens``."""

    tier: str
    ttft_s: tuple[float, ...]  # the prefix loaded from this tier, then the last token computed
    break_even_tokens: int | None  # loading wins from this prefix length on (None: never)
    num_observations: int  # reads its fit has taken (0: still its prior)


@dataclass(frozen=True)
class CostCurves:
    """The cost model's current fit as curves: the predicted TTFT of a prompt of ``n + 1``
    tokens whose first ``n`` (``prefix_tokens``, whole blocks) are recomputed or loaded from
    each tier, as ``CostModel.choose`` would weigh them."""

    prefix_tokens: tuple[int, ...]
    recompute_ttft_s: tuple[float, ...]
    tiers: tuple[TierCurve, ...]
    num_step_observations: int  # model steps the recompute fit has taken
    policy: str = "auto"  # the store's load policy these curves decide under


def cost_curves(
    cost: CostModel,
    tiers: Sequence[str],
    block_size: int,
    chunk_blocks: int,
    max_tokens: int,
    entry_bytes: Callable[[int], int],
    entries_per_chunk: int = 1,
    block_bytes_per_token: float = 0.0,
    num_points: int = 48,
    max_scan: int = 2048,
    extra: Callable[[int], tuple[int, int]] | None = None,
) -> CostCurves:
    """The curves of ``cost`` for prefixes of whole blocks up to ``max_tokens - 1`` tokens.

    Args:
        tiers: tier names, in order.
        chunk_blocks: blocks per stored entry (a prefix of ``n`` blocks is read as
            ``ceil(n / chunk_blocks)`` chunks of ``entries_per_chunk`` entries each).
        entry_bytes: bytes read for one chunk of ``n`` blocks (all its entries).
        block_bytes_per_token: device bytes per token (the copy into the pool).
        num_points: about how many prefix lengths the curves have (log-spaced).
        max_scan: most prefix lengths the break-even is looked for at (every whole block
            when there are fewer; otherwise log-spaced, so it is exact to ~0.5%).
        extra: ``extra(num_blocks) -> (entries, bytes)`` read and copied on top for a
            prefix of that many blocks (a hybrid model's other KV groups).

    A tier's break-even is the shortest prefix from which loading it is predicted to beat
    recomputing it at every longer prefix scanned.
    """
    scan, keep = _scan_grid(max(0, (max_tokens - 1) // block_size), max_scan, num_points)
    if not scan:
        return CostCurves((), (), tuple(TierCurve(t, (), None, 0) for t in tiers), 0)
    lengths = [b * block_size for b in scan]
    recompute = cost.recompute_curve([n + 1 for n in lengths])
    last_token = [cost.t_recompute(n, n + 1) for n in lengths]
    updates = cost.num_updates()
    loads = [
        _prefix_reads(
            n,
            block_size,
            chunk_blocks,
            entry_bytes,
            entries_per_chunk,
            block_bytes_per_token,
            extra,
        )
        for n in scan
    ]
    curves = tuple(
        _tier_curve(cost, tier, loads, last_token, lengths, recompute, keep, updates)
        for tier in tiers
    )
    return CostCurves(
        tuple(lengths[i] for i in keep),
        tuple(recompute[i] for i in keep),
        curves,
        updates["step"],
    )


def _scan_grid(max_blocks: int, max_scan: int, num_points: int) -> tuple[list[int], list[int]]:
    """The prefix lengths (in blocks) the break-even is looked for at, and the indices in
    that scan of the about ``num_points`` of them the curves show (log-spaced)."""
    scan = _log_grid(max_blocks, max_scan)
    shown = set(_log_grid(len(scan), num_points))  # 1-based positions in ``scan``
    return scan, [i for i in range(len(scan)) if i + 1 in shown]


def _tier_curve(
    cost: CostModel,
    tier: str,
    loads: list,
    last_token: list[float],
    lengths: list[int],
    recompute: list[float],
    keep: list[int],
    updates: dict[str, int],
) -> TierCurve:
    """One tier's predicted TTFT at each scanned prefix (its reads ``loads``, then the last
    token computed), its break-even over all of them, the points at ``keep`` shown."""
    ttft = [cost.predict_load(tier, *r) + tail for r, tail in zip(loads, last_token)]
    break_even = _break_even(lengths, ttft, recompute)
    kept = tuple(ttft[i] for i in keep)
    return TierCurve(tier, kept, break_even, updates.get(f"tier_{tier}", 0))


def _prefix_reads(
    num_blocks: int,
    block_size: int,
    chunk_blocks: int,
    entry_bytes,
    entries_per_chunk: int,
    block_bytes_per_token: float,
    extra,
) -> tuple[int, int, int]:
    """(entries read, bytes read, bytes copied) of a stored prefix of ``num_blocks`` blocks
    (``cost_curves``' arguments)."""
    full, rest = divmod(num_blocks, chunk_blocks)
    num_bytes = full * entry_bytes(chunk_blocks) + (entry_bytes(rest) if rest else 0)
    entries = (full + (rest > 0)) * entries_per_chunk
    copy = int(num_blocks * block_size * block_bytes_per_token)
    xn, xb = extra(num_blocks) if extra is not None else (0, 0)
    return entries + xn, num_bytes + xb, copy + xb


def _break_even(
    lengths: Sequence[int], load_ttft: Sequence[float], recompute_ttft: Sequence[float]
) -> int | None:
    """The shortest of ``lengths`` from which loading beats recomputing at every longer one
    (None: recomputing wins at the longest)."""
    break_even = None
    for i in range(len(lengths) - 1, -1, -1):
        if load_ttft[i] > recompute_ttft[i]:
            break
        break_even = lengths[i]
    return break_even


def _log_grid(n: int, max_points: int) -> list[int]:
    """``1 .. n``, or about ``max_points`` of them log-spaced (1 and ``n`` included)."""
    if n <= max_points:
        return list(range(1, n + 1))
    ratio = math.log(n) / (max_points - 1)
    return sorted({min(n, max(1, round(math.exp(i * ratio)))) for i in range(max_points)} | {n})


def _step_features(chunks: Sequence[tuple[int, int]]) -> tuple[float, float, float]:
    num_tokens = sum(n for _, n in chunks)
    attn = sum(((s + n) ** 2 - s**2) / 2 for s, n in chunks)
    return (1.0, num_tokens / 1e3, attn / 1e6)

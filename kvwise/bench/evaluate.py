"""``kvwise eval``: how far a numeric change (quantized weights, a KV format) moves the model's
predictions, as llama.cpp's perplexity / KL-divergence tool measures it.

A candidate model (``--quantization``, ``--kv-cache-dtype``) and a reference
(``--reference-quantization``, float32 weights by default; ``--reference-kv-cache-dtype``,
float32 KV by default) read the same text in sliding windows. A KV format is applied as the
engine applies it: a format the pool stores (other than float32, the exact reference) is
computed by the engine's own pool class and attention backend over the window, as one cold
prefill chunk (``worker/one_sequence.py``: the same writes, kernels and so the same bits as
the engine's step; for ``int4``, keys per channel over each block of ``kv_block_size`` tokens,
a query sees earlier blocks' keys sealed and its own block's keys in full precision).
``int4-pt`` (keys per token, like values) is a measured alternative the pool does not store:
its K and V rows go through ``kv_quant.round_trip`` before dense attention reads them. For
every scored token we take the candidate's
log-probability of the true next token (perplexity = exp(mean NLL)) and, against the reference,
KL(reference || candidate) over the whole vocabulary and whether the two argmaxes agree.

Windows of ``ctx`` tokens start every ``stride`` tokens; only tokens not scored by an earlier
window are scored, so each token is scored once and the tokens before it in the window are its
context (the standard sliding-window perplexity)::

    tokens    0 ....................................................... n
    window 0  [x s s s s s s s s s s s s s s s]          x: context only (nothing predicts it)
    window 1          [c c c c c c c c s s s s s s s s]  c: context, s: scored
    window 2                  [c c c c c c c c s s s s s s s s]
              |<--- stride -->|<------------ ctx ------------>|

With ``stride == ctx`` the windows do not overlap and each window's first token is context only.

The text is tokenized without special tokens (no BOS per window): the figures compare models
on the same token stream, which is what a numeric change is judged by.

``windows="llama.cpp"`` scores what ``llama-perplexity`` (and its ``--kl-divergence``) scores,
so the two engines' figures cover the same tokens (``bench/eval_windows.py``): chunks of ``ctx``
tokens end to end, the second half of each scored but its first token, over the text as
llama.cpp tokenizes it (BOS first when the model adds one; each chunk's first token replaced by
BOS); the tail that fills no chunk is not read::

    tokens    0 ....................................................... n
    chunk 0   [b c c c c c c c c s s s s s s s]          b: BOS (when the model adds one)
    chunk 1                   [b c c c c c c c c s s s s s s s]
              |<------------ ctx ------------>|
                               |<- ctx/2 + 1 ->|

The reference is the candidate's model file at other settings, or another file
(``reference_model``: e.g. the f32 or f16 GGUF a Q4_K_M was made from, or an HF directory),
loaded with ``reference_quantization`` ("none": the file's own exact dequantization in float32).
Only logits are compared, so the two need the same vocabulary: the same number of logits and
the same token string at every id (``check_comparable``); their families, depths and widths may
differ. The text is tokenized once, by the candidate's tokenizer.

The model runs directly (no engine, no scheduler): ``model.forward`` over the window with dense
causal attention (or the pool's, above), logits only for the scored rows, in slices of rows so
that two models' ``(rows, vocab)`` float32 logits stay a few hundred MB at most.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvwise.bench.eval_windows import (
    TextTokenizer,
    default_stride,
    plan,
    vocabulary_mismatch,
)
from kvwise.core.kv_spec import KVSpec, kv_format
from kvwise.models.layers import dense_causal_attention
from kvwise.models.loader import LoadedModel
from kvwise.worker.kv_quant import KEY_BLOCK, round_trip
from kvwise.worker.model_runner import layer_attention
from kvwise.worker.one_sequence import sequence_attention

# Rows of logits per slice: 256 x 49,152 x 4 B = 48 MiB per tensor, a few tensors per model.
ROWS_PER_SLICE = 256


@dataclass(frozen=True)
class EvalResult:
    """What one evaluation measured. The comparison fields are None when it was skipped
    (candidate and reference the same settings, no self-check)."""

    ctx: int
    stride: int
    num_windows: int
    num_scored_tokens: int
    ppl: float
    seconds: float
    reference_ppl: float | None = None
    delta_ppl_pct: float | None = None  # 100 * (ppl / reference_ppl - 1)
    kl_mean: float | None = None  # KL(reference || candidate), nats per token
    kl_p99: float | None = None
    kl_max: float | None = None
    top1_agreement_pct: float | None = None

    @property
    def compared(self) -> bool:
        return self.kl_mean is not None


def evaluate(
    candidate: LoadedModel,
    token_ids: list[int],
    ctx: int,
    stride: int | None = None,
    max_windows: int | None = None,
    reference: LoadedModel | None = None,
    progress: bool = False,
    kv_cache_dtype: str = "float32",
    reference_kv_cache_dtype: str = "float32",
    kv_int4_group_size: int = 0,
    kv_block_size: int = KEY_BLOCK,
    windows: str = "sliding",
    chunk_bos_id: int | None = None,
) -> EvalResult:
    """Perplexity of ``candidate`` on ``token_ids`` over windows and, with ``reference``, its
    KL divergence from and top-1 agreement with the reference at every scored token.

    Args:
        candidate: the model judged.
        token_ids: the text, tokenized by the model's tokenizer.
        ctx: window length in tokens, at most the model's ``max_position_embeddings``.
        stride: tokens between window starts; default ``ctx // 2`` (``ctx`` for llama.cpp's).
        max_windows: stop after this many windows (default: the whole text).
        reference: the model compared against; may be ``candidate`` itself (a self-check: both
            forwards run, so KL ~ 0 and 100% agreement confirm the comparison path), or another
            model with the same vocabulary (``check_comparable``).
        progress: a tqdm bar over windows.
        kv_cache_dtype, reference_kv_cache_dtype: the KV format each side attends over
            (``kv_int4_group_size``: int4's group, 0 for its default; ``kv_block_size``:
            int4's tokens per key block, the pool's block size).
        windows: "sliding" or "llama.cpp" (``bench/eval_windows.py``; the module docstring).
        chunk_bos_id: the id every window's first token is replaced with (llama.cpp's BOS per
            chunk: ``llama_cpp_tokens``), or None to read the tokens as they are.

    Raises:
        ValueError: bad ``windows`` / ``ctx`` / ``stride`` / ``max_windows``, or models that
            disagree on the number of logits.
    """
    stride = default_stride(windows, ctx) if stride is None else stride
    _check_models(candidate, reference, ctx)
    planned = plan(windows, len(token_ids), ctx, stride, max_windows)
    start_time = time.perf_counter()
    bar = tqdm(planned, desc="eval", unit="window", disable=not progress)
    sides = ((candidate, kv_cache_dtype), (reference, reference_kv_cache_dtype))
    totals = _score_windows(
        bar,
        torch.tensor(token_ids, dtype=torch.int64),
        sides,
        (kv_int4_group_size, kv_block_size),
        chunk_bos_id,
    )
    seconds = time.perf_counter() - start_time
    return totals.result(
        EvalResult(ctx, stride, len(planned), totals.num_scored, totals.ppl, seconds)
    )


def _score_windows(bar, tokens: torch.Tensor, sides: tuple, kv: tuple, chunk_bos_id) -> _Totals:
    """Every window of ``bar``: the candidate's (and the reference's) hidden rows of its scored
    tokens, scored. ``sides``: (model, KV format) of the candidate and of the reference (model
    None: no comparison); ``kv``: int4's group and key block."""
    (candidate, kv_dtype), (reference, ref_kv_dtype) = sides
    totals = _Totals()
    with torch.inference_mode():
        for window in bar:
            ids = tokens[window.start : window.end]  # (T,)
            if chunk_bos_id is not None:
                ids = ids.clone()  # the targets read `tokens`, never this copy
                ids[0] = chunk_bos_id
            # hidden row i predicts token start + i + 1: the scored targets' rows
            rows = slice(window.first_scored - 1 - window.start, window.end - 1 - window.start)
            targets = tokens[window.first_scored : window.end]  # (S,)
            hidden = _hidden(candidate, ids, kv_dtype, *kv)[rows]  # (S, hidden)
            ref_hidden = None
            if reference is not None:
                ref_hidden = _hidden(reference, ids, ref_kv_dtype, *kv)[rows]
            totals.add_window(candidate, hidden, targets, reference, ref_hidden)
            bar.set_postfix(ppl=f"{totals.ppl:.3f}", refresh=False)
    return totals


@dataclass
class _Totals:
    """Sums over the scored tokens of every window so far."""

    nll_sum: float = 0.0
    ref_nll_sum: float = 0.0
    num_agree: int = 0
    num_scored: int = 0
    kls: list = field(default_factory=list)  # (rows,) float tensors, one a slice

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.num_scored)

    def add_window(self, candidate, hidden, targets, reference, ref_hidden) -> None:
        """Score one window's rows, ``ROWS_PER_SLICE`` at a time (the logits of a slice only)."""
        for lo in range(0, len(targets), ROWS_PER_SLICE):
            part = slice(lo, lo + ROWS_PER_SLICE)
            ref = None if ref_hidden is None else (reference, ref_hidden[part])
            nll, scored = _score(candidate, hidden[part], targets[part], ref)
            self.nll_sum += nll
            if scored is not None:
                ref_nll, kl, agree = scored
                self.ref_nll_sum += ref_nll
                self.kls.append(kl)
                self.num_agree += agree
        self.num_scored += len(targets)

    def result(self, result: EvalResult) -> EvalResult:
        """``result`` with the comparison's figures when a reference was scored."""
        if not self.kls:
            return result
        kl_all = torch.cat(self.kls).double()  # (num_scored,)
        reference_ppl = math.exp(self.ref_nll_sum / self.num_scored)
        return replace(
            result,
            reference_ppl=reference_ppl,
            delta_ppl_pct=100.0 * (result.ppl / reference_ppl - 1.0),
            kl_mean=kl_all.mean().item(),
            kl_p99=torch.quantile(kl_all, 0.99).item(),
            kl_max=kl_all.max().item(),
            top1_agreement_pct=100.0 * self.num_agree / self.num_scored,
        )


def _check_models(candidate: LoadedModel, reference: LoadedModel | None, ctx: int) -> None:
    for name, loaded in (("the model's", candidate), ("the reference's", reference)):
        if loaded is not None and ctx > loaded.arch.max_position_embeddings:
            raise ValueError(
                f"ctx: {ctx} exceeds {name} context of {loaded.arch.max_position_embeddings} tokens"
            )
    if reference is not None and reference.arch.vocab_size != candidate.arch.vocab_size:
        raise ValueError(
            f"reference: vocabulary of {reference.arch.vocab_size} tokens, the candidate's "
            f"has {candidate.arch.vocab_size}"
        )


def check_comparable(
    candidate: LoadedModel,
    reference: LoadedModel,
    tokenizer: TextTokenizer,
    reference_tokenizer: TextTokenizer,
    flag: str = "--reference-model",
) -> None:
    """Raise ValueError (naming ``flag`` and the reference's file) unless the reference's
    logits mean what the candidate's mean: as many of them, and the same token string at every
    id of the two tokenizers. Families, depths and widths may differ: only logits are compared.
    """
    mismatch = None
    if reference.arch.vocab_size != candidate.arch.vocab_size:
        mismatch = (
            f"{reference.arch.vocab_size} logits a token, the candidate's "
            f"{candidate.arch.vocab_size}"
        )
    mismatch = mismatch or vocabulary_mismatch(tokenizer, reference_tokenizer)
    if mismatch:
        raise ValueError(
            f"{flag} {reference.source}: {mismatch}; only models with the same "
            "vocabulary can be compared"
        )


def _score(candidate: LoadedModel, hidden: torch.Tensor, targets: torch.Tensor, reference):
    """One slice of scored rows: the candidate's summed NLL of ``targets`` and, with
    ``reference`` = (model, its hidden rows), the reference's summed NLL, the per-row
    KL(reference || candidate) and the number of rows whose argmaxes agree."""
    logp = F.log_softmax(candidate.model.compute_logits(hidden), dim=-1)
    target = targets[:, None]  # (s, 1)
    nll = -logp.gather(-1, target).double().sum().item()
    if reference is None:
        return nll, None
    model, ref_hidden = reference
    ref_logp = F.log_softmax(model.model.compute_logits(ref_hidden), -1)
    ref_nll = -ref_logp.gather(-1, target).double().sum().item()
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # (s,)
    agree = int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    return nll, (ref_nll, kl, agree)


def _hidden(
    loaded: LoadedModel,
    ids: torch.Tensor,
    kv_dtype: str = "float32",
    group: int = 0,
    block_size: int = KEY_BLOCK,
) -> torch.Tensor:
    """Final hidden states `(T, hidden)` of one window, attending over K/V in the format
    ``kv_dtype``: the engine's pool and attention for a pool format (float32 aside), else
    dense causal attention over K/V round-tripped through the format."""
    arch = loaded.arch
    positions = torch.arange(len(ids), dtype=torch.int64)  # (T,)
    if _through_pool(kv_dtype):
        fmt = kv_format(kv_dtype)
        spec = KVSpec(
            arch.num_layers,
            arch.num_kv_heads,
            arch.head_dim,
            block_size,
            kv_dtype,
            group_size=group if fmt.grouped else 0,
        )
        layers = layer_attention(loaded.model, arch)
        return loaded.model.forward(
            ids, positions, sequence_attention(spec, arch.num_heads, len(ids), layers=layers)
        )
    kinds = loaded.model.attention_kinds  # each layer's window, scale and soft cap

    def attn(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = round_trip(k.float(), kv_dtype, group, keys=True, key_block=block_size)
        v = round_trip(v.float(), kv_dtype, group)
        kind = kinds[layer_idx]
        return dense_causal_attention(
            q, k, v, kind.softmax_scale, kind.sliding_window, kind.softcap
        )  # (T, H*D)

    return loaded.model.forward(ids, positions, attn)


def _through_pool(kv_dtype: str) -> bool:
    """Measured through the engine's own pool and attention: a format the pool stores, but
    float32 (the exact reference: dense attention is the same maths, and keeps a model's
    sliding window)."""
    return kv_dtype != "float32" and "pool" in kv_format(kv_dtype).uses

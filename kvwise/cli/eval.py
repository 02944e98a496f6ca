"""``kvwise eval``: perplexity, KL divergence and top-1 agreement of a candidate (weights and KV
format) against a reference (the same file at other settings, or ``--reference-model``: another
file of the same vocabulary), over windows of a text (sliding, or llama-perplexity's chunks:
``--windows llama.cpp``) (``kvwise.bench.eval_job``, imported when it runs: it needs torch; its
flags do not)."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    from kvwise.config import QUANTIZATIONS
    from kvwise.core.kv_spec import kv_formats

    p.add_argument(
        "--model", default=None, help="HF directory or .gguf (default: the default model)"
    )
    p.add_argument(
        "--quantization", choices=QUANTIZATIONS, default="auto", help="the candidate's weights"
    )
    p.add_argument(
        "--reference-model",
        default=None,
        metavar="FILE",
        help="compare against this model file or HF directory (e.g. the f32 / f16 GGUF a "
        "quantized file was made from; the same vocabulary), loaded with "
        "--reference-quantization; the text is tokenized by the candidate's tokenizer",
    )
    p.add_argument(
        "--reference-quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="the reference's weights (default none: float32, a GGUF's exact dequantization); "
        "equal to --quantization without --reference-model: the comparison is skipped",
    )
    kv_choices = kv_formats("eval")  # the pool's, and int4-pt (int4, keys per token)
    p.add_argument(
        "--kv-cache-dtype",
        choices=kv_choices,
        default="float32",
        help="the KV format the candidate attends over (default float32; int4: keys "
        "per channel over blocks of --kv-block-size tokens; int4-pt: keys per token, "
        "measured only)",
    )
    p.add_argument(
        "--reference-kv-cache-dtype",
        choices=kv_choices,
        default="float32",
        help="the KV format the reference attends over (default float32)",
    )
    p.add_argument(
        "--kv-int4-group-size",
        type=int,
        default=0,
        help="int4 KV: channels per scale group (default 32)",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=32,
        help="int4: tokens per key block, each channel's scale group (default 32)",
    )
    _add_window_args(p)


def _add_window_args(p: argparse.ArgumentParser) -> None:
    from kvwise.bench.eval_windows import WINDOW_MODES

    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default: 512)")
    p.add_argument(
        "--windows",
        choices=WINDOW_MODES,
        default="sliding",
        help="sliding (default): windows every --stride tokens, each token scored "
        "once; llama.cpp: llama-perplexity's chunks of --ctx tokens end to end, "
        "tokens ctx/2+1.. of each scored, BOS first in each when the model adds one "
        "(its tokens; the text less one trailing newline, as its -f reads it)",
    )
    p.add_argument(
        "--stride", type=int, default=None, help="tokens between windows (ctx // 2; llama.cpp: ctx)"
    )
    p.add_argument(
        "--max-windows",
        type=int,
        default=None,
        help="stop after N windows (all; llama-perplexity's --chunks N)",
    )
    p.add_argument("--text", default=None, help="UTF-8 text file (default: Python's pydoc topics)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON here")
    p.add_argument(
        "--self-check",
        action="store_true",
        help="compare the candidate with itself (both forwards run): KL ~ 0, 100%% agreement",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from kvwise.bench.eval_job import run as evaluate

    evaluate(
        args.model,
        args.quantization,
        args.reference_quantization,
        args.ctx,
        stride=args.stride,
        max_windows=args.max_windows,
        text=args.text,
        json_path=args.json,
        self_check=args.self_check,
        progress=not args.no_progress,
        kv_cache_dtype=args.kv_cache_dtype,
        reference_kv_cache_dtype=args.reference_kv_cache_dtype,
        kv_int4_group_size=args.kv_int4_group_size,
        kv_block_size=args.kv_block_size,
        reference_model=args.reference_model,
        windows=args.windows,
    )
    return 0

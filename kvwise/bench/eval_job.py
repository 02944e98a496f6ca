"""``kvwise eval`` as a job: its settings checked before anything loads, the model(s) loaded,
the corpus tokenized, ``evaluate.evaluate`` run, and its figures printed as a table and
written as a JSON record (what the record holds: ``_record``; the comparison's mode:
``_load_models``). The measurement itself is ``bench/evaluate.py``."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from kvwise.bench.eval_windows import (
    Corpus,
    TextTokenizer,
    check_window_settings,
    default_stride,
    llama_cpp_tokens,
    plan,
    token_ids_sha256,
)
from kvwise.bench.evaluate import EvalResult, check_comparable, evaluate
from kvwise.core.kv_spec import kv_format, kv_formats
from kvwise.models.loader import LoadedModel, load_model
from kvwise.worker.kv_quant import KEY_BLOCK


def run(
    model: str | None,
    quantization: str,
    reference_quantization: str,
    ctx: int,
    stride: int | None = None,
    max_windows: int | None = None,
    text: str | None = None,
    json_path: str | None = None,
    self_check: bool = False,
    progress: bool = True,
    kv_cache_dtype: str = "float32",
    reference_kv_cache_dtype: str = "float32",
    kv_int4_group_size: int = 0,
    kv_block_size: int = KEY_BLOCK,
    reference_model: str | None = None,
    windows: str = "sliding",
) -> EvalResult:
    """``kvwise eval``: load the model(s), tokenize the corpus, evaluate, print a table and
    write ``json_path``. The candidate is loaded once; the reference is loaded too when its
    quantization differs, shares the candidate's weights when only the KV format differs, and
    the comparison is skipped when both settings are equal, unless ``self_check`` compares the
    candidate with itself. With ``reference_model`` the reference is that file at
    ``reference_quantization`` (the candidate itself only when it is the same file at the same
    quantization), always compared, and checked to share the candidate's vocabulary.

    Raises:
        ValueError: a bad setting, a model load_model refuses (named by its flag), or a
            reference model of another vocabulary (naming ``--reference-model``).
    """
    stride = default_stride(windows, ctx) if stride is None else stride
    _check_settings(
        ctx,
        stride,
        max_windows,
        windows,
        (kv_cache_dtype, reference_kv_cache_dtype),
        kv_int4_group_size,
        kv_block_size,
        (self_check, reference_model),
    )
    corpus = Corpus.from_file(text) if text else Corpus.default()
    started = time.perf_counter()
    candidate, reference, mode = _load_models(
        (model, reference_model),
        (quantization, reference_quantization),
        kv_cache_dtype == reference_kv_cache_dtype,
        self_check,
        progress,
    )
    load_seconds = time.perf_counter() - started
    if kv_int4_group_size and candidate.arch.head_dim % kv_int4_group_size:
        raise ValueError(
            f"kv_int4_group_size: {kv_int4_group_size} does not divide head_dim "
            f"{candidate.arch.head_dim}"
        )
    token_ids, chunk_bos_id = _tokens(candidate, reference, corpus.text, windows)
    result = evaluate(
        candidate,
        token_ids,
        ctx,
        stride,
        max_windows,
        reference,
        progress,
        kv_cache_dtype,
        reference_kv_cache_dtype,
        kv_int4_group_size,
        kv_block_size,
        windows,
        chunk_bos_id,
    )
    settings = _settings(
        self_check,
        (quantization, reference_quantization),
        (kv_cache_dtype, reference_kv_cache_dtype),
        (kv_int4_group_size, kv_block_size),
        windows,
    )
    num_tokens_read = plan(windows, len(token_ids), ctx, stride, max_windows)[-1].end
    record = _record(candidate, reference, mode, settings, corpus, (token_ids, num_tokens_read))
    _report(result, {**record, "load_seconds": load_seconds}, json_path)
    return result


def _settings(self_check: bool, quantizations: tuple, kv_dtypes: tuple, int4: tuple, windows):
    """The record's settings (a self-check's reference: the candidate's own)."""
    (quantization, reference_quantization), (kv, reference_kv) = quantizations, kv_dtypes
    return {
        "quantization": quantization,
        "reference_quantization": quantization if self_check else reference_quantization,
        "kv_cache_dtype": kv,
        "reference_kv_cache_dtype": kv if self_check else reference_kv,
        "kv_int4_group_size": int4[0],
        "kv_block_size": int4[1],
        "windows": windows,
    }


def _report(result: EvalResult, record: dict, json_path: str | None) -> None:
    """The table on stdout; the record with the figures at ``json_path``."""
    record.update(asdict(result))
    print(format_table(result, record))
    if json_path:
        Path(json_path).write_text(json.dumps(record, indent=2) + "\n")


def _tokens(candidate, reference, text: str, windows: str) -> tuple[list[int], int | None]:
    """The text by the candidate's tokenizer (a reference of another file checked to share
    its vocabulary first), and the id each window starts with (None: the tokens as they are)."""
    from kvwise.engine.builder import tokenizer_for

    tokenizer = tokenizer_for(candidate)
    if reference is not None and reference is not candidate:
        check_comparable(candidate, reference, tokenizer, tokenizer_for(reference))
    return _tokenize(tokenizer, text, windows)


def _tokenize(tokenizer: TextTokenizer, text: str, windows: str) -> tuple[list[int], int | None]:
    """The token stream and the id each window starts with (None: the tokens as they are)."""
    if windows == "llama.cpp":
        return llama_cpp_tokens(tokenizer, text)
    return tokenizer.encode(text, add_special_tokens=False), None


def _record(candidate, reference, mode: str, settings: dict, corpus, tokens: tuple) -> dict:
    """What the JSON record says besides the figures: the models, the settings, the corpus and
    the environment, in the order the record has always had. ``tokens``: the text's token ids
    and how many of them the windows read (the tokens llama.cpp's logits file holds, whose
    int32 ids' sha256 the record gives)."""
    token_ids, num_tokens_read = tokens
    return {
        "model": str(candidate.source),
        "reference_model": str(reference.source) if reference else None,
        "fingerprint": candidate.fingerprint,
        "quantization": settings["quantization"],
        "weight_format": candidate.weight_format,  # what "auto" resolved to
        **{k: v for k, v in settings.items() if k != "quantization"},
        "reference_weight_format": reference.weight_format if reference else None,
        "reference_fingerprint": reference.fingerprint if reference else None,
        "comparison": mode,
        "corpus": {
            "name": corpus.name,
            "sha256": corpus.sha256,
            "num_chars": len(corpus.text),
            "num_tokens": len(token_ids),
            "num_tokens_read": num_tokens_read,
            "tokens_read_sha256": token_ids_sha256(token_ids[:num_tokens_read]),
        },
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
    }


def _load_models(
    models: tuple[str | None, str | None],
    quantizations: tuple[str, str],
    same_kv: bool,
    self_check: bool,
    progress: bool,
) -> tuple[LoadedModel, LoadedModel | None, str]:
    """The candidate, the reference (loaded only when its weights differ; the candidate itself
    when only the KV format does; None when nothing differs) and the comparison's mode.
    ``models``: the candidate's path and the reference model's (None: the candidate's file)."""
    (model, reference_model), (quantization, reference_quantization) = models, quantizations
    candidate = _load(model, quantization, "--quantization", progress)
    if self_check:
        return candidate, candidate, "self-check"
    if reference_model is not None:
        same_file = Path(reference_model).expanduser().resolve() == candidate.source.resolve()
        if same_file and reference_quantization == quantization:
            return candidate, candidate, "reference-model"  # the same weights: both forwards run
        flag = f"--reference-model {reference_model}: --reference-quantization"
        return (
            candidate,
            _load(reference_model, reference_quantization, flag, progress),
            ("reference-model"),
        )
    if reference_quantization == quantization:
        # the same weights: another KV format, or nothing to compare
        return candidate, (None if same_kv else candidate), ("skipped" if same_kv else "reference")
    reference = _load(model, reference_quantization, "--reference-quantization", progress)
    return candidate, reference, "reference"


def _check_settings(
    ctx: int,
    stride: int,
    max_windows: int | None,
    windows: str,
    kv_dtypes: tuple[str, str],
    kv_int4_group_size: int,
    kv_block_size: int,
    self_check_of: tuple[bool, str | None] = (False, None),
) -> None:
    """``run``'s settings, checked before anything loads (``self_check_of``: self_check and
    the reference model, which exclude each other)."""
    check_window_settings(ctx, stride, max_windows, windows)
    for name, dtype in zip(("kv_cache_dtype", "reference_kv_cache_dtype"), kv_dtypes):
        if dtype not in kv_formats("eval"):
            raise ValueError(f"{name}: expected one of {kv_formats('eval')}, got {dtype!r}")
    if kv_int4_group_size and (kv_int4_group_size < 2 or kv_int4_group_size % 2):
        raise ValueError(f"kv_int4_group_size: expected an even number, got {kv_int4_group_size}")
    if kv_block_size < 2 or kv_block_size % 2:
        raise ValueError(f"kv_block_size: expected an even number of tokens, got {kv_block_size}")
    self_check, reference_model = self_check_of
    if self_check and reference_model is not None:
        raise ValueError(
            "self_check: compares the candidate with itself, not with "
            f"--reference-model {reference_model}"
        )


def _load(model: str | None, quantization: str, flag: str, progress: bool) -> LoadedModel:
    try:
        return load_model(model, dtype=torch.float32, progress=progress, quantization=quantization)
    except ValueError as e:
        raise ValueError(f"{flag} {quantization}: {e}") from None


def format_table(result: EvalResult, record: dict) -> str:
    """The human-readable summary (a Markdown table, to paste into BENCHMARKS.md)."""
    q = _label(record["quantization"], record["weight_format"])
    ref_q = _label(record["reference_quantization"], record["reference_weight_format"])
    kv, ref_kv = record.get("kv_cache_dtype"), record.get("reference_kv_cache_dtype")
    if kv and (kv != "float32" or ref_kv != "float32"):
        group = record.get("kv_int4_group_size") or 32
        block = record.get("kv_block_size") or 32

        def kv_label(name: str) -> str:
            fmt = kv_format(name)
            if not fmt.grouped:
                return f", KV {name}"
            halves = [
                f"{half} per channel over {block} tokens"
                if scales.per == "channel"
                else f"{half} per token"
                for half, scales in (("keys", fmt.key_scales), ("values", fmt.value_scales))
                if scales is not None
            ]
            return f", KV {name} ({', '.join(halves)}, g{group})"

        q += kv_label(kv)
        ref_q += kv_label(ref_kv)
    name = Path(record["model"]).name
    models = f"model {name}"
    reference_model = record.get("reference_model")
    if reference_model and reference_model != record["model"]:  # name both files
        ref_name = Path(reference_model).name
        models = f"model {name} vs reference {ref_name}"
        q, ref_q = f"{name}, {q}", f"{ref_name}, {ref_q}"
    corpus = record["corpus"]
    if record.get("windows") == "llama.cpp":
        planned = f"llama.cpp chunks (tokens {result.ctx // 2 + 1}.. of each scored)"
    else:
        planned = f"stride {result.stride}"
    lines = [
        f"{models}; corpus {corpus['name']}: "
        f"{corpus['num_tokens']:,} tokens, sha256 {corpus['sha256'][:12]}",
        f"ctx {result.ctx}, {planned}, {result.num_windows} windows, "
        f"{result.num_scored_tokens:,} scored tokens, {result.seconds:.1f} s",
        "",
        "| metric | value |",
        "|---|---:|",
        f"| perplexity, candidate ({q}) | {result.ppl:.4f} |",
    ]
    if not result.compared:
        lines.append(f"| comparison | skipped: reference ({ref_q}) = candidate |")
        return "\n".join(lines)
    lines += [
        f"| perplexity, reference ({ref_q}) | {result.reference_ppl:.4f} |",
        f"| ΔPPL | {result.delta_ppl_pct:+.3f}% |",
        f"| KL mean | {result.kl_mean:.6f} |",
        f"| KL p99 | {result.kl_p99:.6f} |",
        f"| KL max | {result.kl_max:.6f} |",
        f"| top-1 agreement | {result.top1_agreement_pct:.2f}% |",
    ]
    if record["comparison"] == "self-check":
        lines.append("| comparison | self-check: the candidate against itself |")
    return "\n".join(lines)


def _label(quantization: str, weight_format: str | None) -> str:
    """``int8``, or ``auto: int4`` when the setting resolved to a format of another name."""
    if weight_format is None or weight_format == quantization:
        return quantization
    return f"{quantization}: {weight_format}"

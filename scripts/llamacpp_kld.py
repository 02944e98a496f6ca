"""llama.cpp's own accuracy figures, on the text and tokens ``kvwise eval --windows llama.cpp``
scores, as JSON: the other side of issue 27's side-by-side. A benchmark tool: nothing here runs
in the test suite.

  python scripts/llamacpp_kld.py --llama-perplexity BIN --reference F32.gguf \\
      --candidate Q4_K_M.gguf [Q8_0.gguf ...] [--text FILE] [-c 2048] [--chunks 16] \\
      [--threads 2] [--check-tokens] [--with-kvwise auto] [--json OUT]

1. ``llama-perplexity -m REFERENCE -f TEXT -c C [--chunks N] --kl-divergence-base BASE``: the
   reference's perplexity, and its log-probabilities at the scored positions saved in BASE (16
   bits per vocabulary entry: chunks x (C/2 - 1) x vocab x 2 bytes, 1.6 GB for 16 chunks of
   2,048 over a 49,152-token vocabulary; a temporary file unless ``--base-file``).
2. per candidate: ``llama-perplexity -m CANDIDATE -c C --kl-divergence --kl-divergence-base
   BASE`` (it reads the tokens from BASE), its final statistics parsed: Mean PPL(Q) and
   PPL(base), Mean PPL(Q)/PPL(base), Mean KLD and its percentiles, RMS Δp, Same top p (top-1
   agreement). Keys as kvwise's record names them (ppl, reference_ppl, delta_ppl_pct, kl_mean,
   kl_p99, kl_max, top1_agreement_pct), each with its ``_unc`` where llama.cpp prints one.
3. ``--check-tokens``: BASE's tokens against the ones kvwise reads (each candidate's tokenizer,
   ``kvwise.bench.eval_windows.llama_cpp_tokens``): equal, or where they first differ; their
   sha256 is what kvwise's record gives as ``corpus.tokens_read_sha256``.
4. ``--with-kvwise QUANT``: ``kvwise eval --model CANDIDATE --quantization QUANT
   --reference-model REFERENCE --windows llama.cpp --ctx C --max-windows CHUNKS --text TEXT``
   in this process, its record next to llama.cpp's, and issue 27's acceptance per candidate:
   kvwise's mean KL <= llama.cpp's x 1.1, its top-1 agreement >= llama.cpp's - 0.5 points.
   Without it the command is printed, to run apart.

Without ``--text`` the default corpus (Python's pydoc topics, what ``kvwise eval`` reads by
default) is written to a temporary file. Both sides score the same tokens: chunks of C tokens
end to end, tokens C/2 + 1 .. C - 1 of each, BOS first in each when the model adds one (the text
less one trailing newline, as ``-f`` reads it). llama.cpp's KL differs from kvwise's in two
small ways: the reference's log-probabilities are kept in 16 bits over each row's range, and
the terms of tokens whose reference log-probability is below -16 are dropped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_NUM = r"([-+]?(?:nan|inf|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?))"
_PM = rf"{_NUM}\s*±\s*{_NUM}"
# kvwise's name -> llama.cpp's final statistics line (a value, or a value ± its uncertainty)
_KLD_LINES = {
    "ppl": rf"Mean PPL\(Q\)\s*:\s*{_PM}",
    "reference_ppl": rf"Mean PPL\(base\)\s*:\s*{_PM}",
    "ln_ppl_ratio": rf"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*{_PM}",
    "ppl_ratio": rf"Mean PPL\(Q\)/PPL\(base\)\s*:\s*{_PM}",
    "kl_mean": rf"Mean\s+KLD:\s*{_PM}",
    "kl_max": rf"Maximum KLD:\s*{_NUM}",
    "kl_p99_9": rf"99\.9%\s+KLD:\s*{_NUM}",
    "kl_p99": rf"99\.0%\s+KLD:\s*{_NUM}",
    "kl_median": rf"Median\s+KLD:\s*{_NUM}",
    "rms_dp_pct": rf"RMS Δp\s*:\s*{_PM}\s*%",
    "top1_agreement_pct": rf"Same top p:\s*{_PM}\s*%",
}
_BASE_PPL = rf"Final estimate: PPL = {_NUM} \+/- {_NUM}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--llama-perplexity", required=True, type=Path, help="the llama-perplexity binary"
    )
    p.add_argument("--reference", required=True, type=Path, help="the reference GGUF (f32 / f16)")
    p.add_argument("--candidate", required=True, nargs="+", type=Path, help="candidate GGUF(s)")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text (default: pydoc topics)")
    p.add_argument("-c", "--ctx", type=int, default=2048, help="chunk length (default 2048)")
    p.add_argument("--chunks", type=int, default=None, help="at most N chunks (default: all)")
    p.add_argument("--threads", "-t", type=int, default=None, help="llama.cpp's -t")
    p.add_argument("--base-file", type=Path, default=None,
                   help="keep the reference's log-probabilities here (default: a temp file)")  # fmt: skip
    p.add_argument("--check-tokens", action="store_true",
                   help="compare llama.cpp's tokens with kvwise's for each candidate")  # fmt: skip
    p.add_argument("--with-kvwise", metavar="QUANT", default=None,
                   help="also run kvwise eval at this --quantization on each candidate")  # fmt: skip
    p.add_argument("--cache-type", metavar="TYPE", default=None,
                   help="the candidates' KV cache type (llama.cpp's -ctk/-ctv, e.g. q4_0, with "
                        "flash attention on, which a quantized V cache needs); the reference's "
                        "stays f16")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results here")
    args = p.parse_args(argv)
    for path in (args.llama_perplexity, args.reference, *args.candidate):
        if not path.is_file():
            p.error(f"{path}: no such file")
    return args


def run_llama(command: list[str]) -> tuple[str, float]:
    """Run llama-perplexity; its stdout and stderr together, and the seconds it took.

    Raises:
        RuntimeError: it failed (the end of its output in the message).
    """
    print("$", " ".join(command), file=sys.stderr, flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, errors="replace")
    seconds = time.perf_counter() - started
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} exited {done.returncode}:\n{output[-3000:]}")
    return output, seconds


def parse_base(output: str) -> dict:
    """The reference run's perplexity (llama.cpp's ``Final estimate``)."""
    match = re.search(_BASE_PPL, output)
    if match is None:
        raise RuntimeError(
            f"no 'Final estimate: PPL' in llama-perplexity's output:\n{output[-3000:]}"
        )
    return {"ppl": float(match[1]), "ppl_unc": float(match[2])}


def parse_kld(output: str) -> dict:
    """The ``--kl-divergence`` run's final statistics, under kvwise's names."""
    figures: dict[str, float] = {}
    for name, pattern in _KLD_LINES.items():
        match = re.search(pattern, output)
        if match is None:
            raise RuntimeError(f"no {name} ({pattern!r}) in llama-perplexity's output (it prints "
                               f"no statistics below 100 scored tokens):\n{output[-3000:]}")  # fmt: skip
        figures[name] = float(match[1])
        if match.lastindex == 2:
            figures[f"{name}_unc"] = float(match[2])
    figures["delta_ppl_pct"] = 100.0 * (figures["ppl_ratio"] - 1.0)
    return figures


def read_base_header(path: Path) -> dict:
    """What BASE says of the run: n_ctx, the vocabulary, the chunks and their tokens (int32)."""
    with path.open("rb") as f:
        if f.read(8) != b"_logits_":
            raise RuntimeError(f"{path}: not a llama-perplexity log-probabilities file")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", f.read(12))
        raw = f.read(4 * n_ctx * n_chunk)
    tokens = list(struct.unpack(f"<{n_ctx * n_chunk}i", raw))
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "num_chunks": n_chunk, "tokens": tokens}


def check_tokens(candidate: Path, text: str, llama_tokens: list[int]) -> dict:
    """kvwise's tokens of ``text`` (the candidate's tokenizer) against llama.cpp's."""
    from kvwise.bench.eval_windows import llama_cpp_tokens, token_ids_sha256
    from kvwise.engine.tokenizer import Tokenizer

    try:
        ids, _ = llama_cpp_tokens(Tokenizer.from_path(candidate), text)
    except ValueError as e:
        return {"tokens_match": None, "error": str(e)}
    ids = ids[: len(llama_tokens)]
    first = next((i for i, (a, b) in enumerate(zip(ids, llama_tokens)) if a != b), None)
    if first is None and len(ids) != len(llama_tokens):
        first = min(len(ids), len(llama_tokens))
    return {
        "tokens_match": first is None,
        "first_mismatch": first,
        "kvwise_tokens_read_sha256": token_ids_sha256(ids),
    }


def run_kvwise(candidate: Path, reference: Path, args, text: Path, num_chunks: int) -> dict:
    """``kvwise eval`` on the same chunks; its JSON record."""
    from kvwise.bench.eval_job import run

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        # without --text kvwise reads its default corpus: the text written for llama.cpp
        run(str(candidate), args.with_kvwise, "none", args.ctx, max_windows=num_chunks,
            text=args.text and str(text), json_path=str(out), reference_model=str(reference),
            windows="llama.cpp")  # fmt: skip
        return json.loads(out.read_text())


def kvwise_command(candidate: Path, reference: Path, args, text: Path, num_chunks: int) -> str:
    return (f".venv/bin/kvwise eval --model {candidate} --quantization {args.with_kvwise or 'auto'}"
            f" --reference-model {reference} --windows llama.cpp --ctx {args.ctx}"
            f" --max-windows {num_chunks}" + (f" --text {text}" if args.text else ""))  # fmt: skip


def acceptance(llama: dict, kvwise: dict) -> dict:
    """Issue 27's accuracy bar: kvwise's KL <= llama.cpp's x 1.1, top-1 >= llama.cpp's - 0.5."""
    return {
        "kl_ratio": kvwise["kl_mean"] / llama["kl_mean"] if llama["kl_mean"] else None,
        "top1_diff_points": kvwise["top1_agreement_pct"] - llama["top1_agreement_pct"],
        "kl_ok": kvwise["kl_mean"] <= 1.1 * llama["kl_mean"],
        "top1_ok": kvwise["top1_agreement_pct"] >= llama["top1_agreement_pct"] - 0.5,
    }


def table(results: dict) -> str:
    """A Markdown table, one row per candidate."""
    lines = ["| candidate | llama.cpp PPL | ΔPPL | KL mean | KL p99 | top-1 | kvwise KL | "
             "kvwise top-1 | KL ratio | top-1 diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in results["candidates"]:
        ll, kv, ok = row["llama_cpp"], row.get("kvwise"), row.get("acceptance")
        cells = [Path(row["model"]).name, f"{ll['ppl']:.4f}", f"{ll['delta_ppl_pct']:+.3f}%",
                 f"{ll['kl_mean']:.6f}", f"{ll['kl_p99']:.6f}", f"{ll['top1_agreement_pct']:.2f}%"]  # fmt: skip
        if kv and ok:
            ratio = "n/a" if ok["kl_ratio"] is None else f"{ok['kl_ratio']:.3f}"
            cells += [f"{kv['kl_mean']:.6f}", f"{kv['top1_agreement_pct']:.2f}%",
                      ratio + (" ✓" if ok["kl_ok"] else " ✗"),
                      f"{ok['top1_diff_points']:+.2f}" + (" ✓" if ok["top1_ok"] else " ✗")]  # fmt: skip
        else:
            cells += ["", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llamacpp_kld_") as tmp:
        text = args.text
        if text is None:
            from kvwise.bench.eval_windows import Corpus

            text = Path(tmp) / "pydoc_topics.txt"
            text.write_text(Corpus.default().text, encoding="utf-8")
        base_file = args.base_file or Path(tmp) / "base.kld"
        results = measure(args, text, base_file)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def measure(args, text: Path, base_file: Path) -> dict:
    """Both llama-perplexity steps (and, as asked, the token check and kvwise's figures)."""
    binary = str(args.llama_perplexity)
    common = ["-c", str(args.ctx)] + (["-t", str(args.threads)] if args.threads else [])
    base_cmd = [binary, "-m", str(args.reference), "-f", str(text), *common,
                "--kl-divergence-base", str(base_file)]  # fmt: skip
    if args.chunks:
        base_cmd += ["--chunks", str(args.chunks)]
    output, seconds = run_llama(base_cmd)
    header = read_base_header(base_file)
    text_str = text.read_text(encoding="utf-8")
    tokens = header.pop("tokens")
    num_chunks = header["num_chunks"]
    results = {
        "llama_perplexity": binary,
        "version": _version(binary),
        "text": str(text),
        "text_sha256": hashlib.sha256(text_str.encode("utf-8")).hexdigest(),
        "ctx": args.ctx,
        **header,
        "num_scored_tokens": num_chunks * (args.ctx - args.ctx // 2 - 1),
        "tokens_read_sha256": hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest(),
        "reference": {"model": str(args.reference), "seconds": seconds, **parse_base(output)},
        "candidates": [],
    }
    kv = ["-fa", "on", "-ctk", args.cache_type, "-ctv", args.cache_type] if args.cache_type else []
    results["cache_type"] = args.cache_type or "f16"
    for candidate in args.candidate:
        output, seconds = run_llama([binary, "-m", str(candidate), *common, *kv, "--kl-divergence",
                                     "--kl-divergence-base", str(base_file)])  # fmt: skip
        row = {"model": str(candidate), "llama_cpp": {"seconds": seconds, **parse_kld(output)}}
        if args.check_tokens:
            row["tokens"] = check_tokens(candidate, text_str, tokens)
        if args.with_kvwise:
            row["kvwise"] = run_kvwise(candidate, args.reference, args, text, num_chunks)
            row["acceptance"] = acceptance(row["llama_cpp"], row["kvwise"])
        else:
            print(kvwise_command(candidate, args.reference, args, text, num_chunks), flush=True)
        results["candidates"].append(row)
    return results


def _version(binary: str) -> str:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, errors="replace")
    return (done.stdout + done.stderr).strip().splitlines()[0] if done.stdout + done.stderr else ""


if __name__ == "__main__":
    sys.exit(main())

"""``kvwise eval`` on the default model: plausible perplexity, a self-check that finds nothing,
a perturbed candidate that it does catch, transformers' perplexity on the same window, and the
command end to end (JSON, clean errors). Then two files (``--reference-model``) on tiny GGUFs
written here, with a small byte-level vocabulary: a file against a copy of itself, a Q8_0 file
against the f32 one it was made from, other vocabularies refused; and llama-perplexity's
windows (``--windows llama.cpp``)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import shutil
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvwise.bench import eval_job
from kvwise.bench import evaluate as evaluate_module
from kvwise.bench.eval_windows import (
    Corpus,
    llama_cpp_tokens,
    plan_chunks,
    plan_windows,
    token_ids_sha256,
    vocabulary_mismatch,
)
from kvwise.bench.evaluate import check_comparable, evaluate
from kvwise.cli import main
from kvwise.engine.builder import tokenizer_for
from kvwise.models.loader import load_model

CTX = 128


@pytest.fixture(scope="module")
def corpus_ids(smollm2) -> list[int]:
    """The default corpus in the default model's tokens."""
    return tokenizer_for(smollm2).encode(Corpus.default().text, add_special_tokens=False)


@pytest.mark.parametrize(
    "num_tokens, ctx, stride", [(1000, 128, 64), (1000, 128, 100), (1000, 128, 1), (50, 128, 64)]
)
def test_windows_score_every_token_but_the_first_once(num_tokens, ctx, stride):
    windows = plan_windows(num_tokens, ctx, stride)
    scored = [t for w in windows for t in range(w.first_scored, w.end)]
    assert scored == list(range(1, num_tokens))
    assert windows[0].start == 0 and windows[-1].end == num_tokens
    assert all(w.end - w.start <= ctx and w.first_scored > w.start for w in windows)
    assert all(w.num_scored == stride for w in windows[1:-1])


def test_windows_without_overlap_and_limits():
    windows = plan_windows(300, 100, 100)
    assert [(w.start, w.end, w.first_scored) for w in windows] == [
        (0, 100, 1),
        (100, 200, 101),
        (200, 300, 201),
    ]
    assert len(plan_windows(10_000, 128, 64, max_windows=3)) == 3
    for ctx, stride, max_windows in [(0, 1, None), (1, 1, None), (8, 0, None), (8, 9, None)]:
        with pytest.raises(ValueError, match="ctx|stride"):
            plan_windows(100, ctx, stride, max_windows)
    with pytest.raises(ValueError, match="max_windows"):
        plan_windows(100, 8, 4, 0)


def test_default_corpus_is_pydoc_topics():
    from pydoc_data.topics import topics

    corpus = Corpus.default()
    assert corpus.text == "".join(topics[k] for k in sorted(topics))
    assert corpus.sha256 == hashlib.sha256(corpus.text.encode()).hexdigest()


def test_perplexity_is_plausible_and_self_check_finds_nothing(smollm2, corpus_ids):
    result = evaluate(smollm2, corpus_ids, CTX, max_windows=2)
    assert 1.0 < result.ppl < 100.0
    assert (result.num_windows, result.num_scored_tokens, result.stride) == (2, 127 + 64, 64)
    assert not result.compared and result.kl_mean is None

    check = evaluate(smollm2, corpus_ids, CTX, max_windows=2, reference=smollm2)
    assert check.ppl == pytest.approx(result.ppl, rel=1e-6)
    assert check.reference_ppl == pytest.approx(check.ppl, rel=1e-6)
    assert abs(check.kl_mean) < 1e-6 and abs(check.kl_max) < 1e-6
    assert check.top1_agreement_pct == 100.0


def test_perturbed_candidate_is_caught(smollm2, corpus_ids):
    model = copy.deepcopy(smollm2.model)
    weight = model.layers[10].gate_up_proj  # (hidden, 2 * intermediate)
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    weight.add_(noise * weight.std() * 0.5)
    perturbed = dataclasses.replace(smollm2, model=model)

    result = evaluate(perturbed, corpus_ids, CTX, max_windows=2, reference=smollm2)
    assert abs(result.delta_ppl_pct) > 0.1
    assert result.kl_mean > 1e-3 and result.kl_max >= result.kl_p99 >= 0.0
    assert result.top1_agreement_pct < 100.0


def test_ctx_beyond_the_model_is_refused(smollm2, corpus_ids):
    ctx = smollm2.arch.max_position_embeddings + 1
    with pytest.raises(ValueError, match="ctx"):
        evaluate(smollm2, corpus_ids, ctx, max_windows=1)


def test_kv_formats_cost_in_their_order_measured_through_the_pool(smollm2, corpus_ids, monkeypatch):
    """A pool format is measured by the engine's own pool and attention (one call a window),
    int4-pt (never stored) by its round trip; KL from float32 KV grows as the format narrows."""
    calls = []

    def counted(spec, *args, **kwargs):
        calls.append(spec.dtype)
        return sequence_attention(spec, *args, **kwargs)

    sequence_attention = evaluate_module.sequence_attention
    monkeypatch.setattr(evaluate_module, "sequence_attention", counted)
    kl = {}
    for dtype in ("bfloat16", "int8", "int4", "int4-pt"):
        result = evaluate(smollm2, corpus_ids, CTX, max_windows=1, reference=smollm2,
                          kv_cache_dtype=dtype)  # fmt: skip
        kl[dtype] = result.kl_mean
    assert calls == ["bfloat16", "int8", "int4"]  # the float32 reference: dense attention
    assert 0 < kl["bfloat16"] < kl["int8"] < kl["int4"] < kl["int4-pt"], kl


@pytest.mark.slow
def test_perplexity_matches_transformers(smollm2, hf_smollm2, corpus_ids):
    ids = torch.tensor(corpus_ids[:CTX])
    with torch.inference_mode():
        logits = hf_smollm2(ids[None]).logits[0].float()  # (CTX, vocab)
    expected = math.exp(F.cross_entropy(logits[:-1], ids[1:]).item())
    result = evaluate(smollm2, corpus_ids, CTX, max_windows=1)
    assert result.num_scored_tokens == CTX - 1
    assert result.ppl == pytest.approx(expected, rel=0.01)


def test_cli_writes_json(tmp_path, capsys):
    from pydoc_data.topics import topics

    text = tmp_path / "text.txt"
    text.write_text(topics["assignment"] + topics["for"])
    out = tmp_path / "eval.json"
    args = ["eval", "--ctx", "64", "--max-windows", "1", "--quantization", "none"]
    args += ["--self-check", "--text", str(text), "--json", str(out), "--no-progress"]
    assert main(args) == 0
    record = json.loads(out.read_text())
    assert record["comparison"] == "self-check" and record["quantization"] == "none"
    assert record["weight_format"] == record["reference_weight_format"] == "none"
    assert record["reference_fingerprint"] == record["fingerprint"]
    assert record["corpus"]["sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()
    assert record["corpus"]["num_tokens"] > 64 and record["python_version"]
    assert (record["ctx"], record["stride"], record["num_windows"]) == (64, 32, 1)
    assert record["num_scored_tokens"] == 63 and 1.0 < record["ppl"] < 1000.0
    for key in ("reference_ppl", "delta_ppl_pct", "kl_mean", "kl_p99", "kl_max", "seconds"):
        assert isinstance(record[key], float)
    assert record["top1_agreement_pct"] == 100.0
    assert "top-1 agreement" in capsys.readouterr().out


def test_cli_errors_are_clean(tmp_path, capsys, monkeypatch):
    assert main(["eval", "--ctx", "0", "--quantization", "none"]) == 2
    assert "ctx" in capsys.readouterr().err
    assert main(["eval", "--ctx", "64", "--stride", "65", "--quantization", "none"]) == 2
    assert "stride" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "missing.gguf"), "--quantization", "none"]) == 2
    assert "does not exist" in capsys.readouterr().err

    def refuse(path, dtype, progress, quantization):
        # what load_model says of a quantization it does not support (int8, int4 until built)
        raise ValueError(f"quantization: {quantization!r} is not built yet")

    monkeypatch.setattr(eval_job, "load_model", refuse)
    assert main(["eval", "--quantization", "int8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--quantization int8" in err and "not built yet" in err and "Traceback" not in err


# ---- two files (--reference-model) and llama.cpp's windows, on tiny GGUFs ----------------------

TINY_CTX = 64
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a", "o n", "r e"]


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the symbol standing for each byte 0..255, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, num_moved = [], 0
    for byte in range(256):
        symbols.append(chr(byte) if byte in printable else chr(256 + num_moved))
        num_moved += byte not in printable
    return symbols


def _vocabulary(swap: bool = False, num_extra: int = 0) -> tuple[list[str], list[int]]:
    """Bytes, the merges' tokens, EOS and BOS (control), ``num_extra`` more control tokens;
    ``swap``: "A" and "B" trade ids."""
    tokens = _byte_symbols() + ["".join(m.split()) for m in _MERGES]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<s>"] + [f"<extra_{i}>" for i in range(num_extra)]
    types += [3] * (len(tokens) - len(types))
    if swap:
        tokens[65], tokens[66] = tokens[66], tokens[65]
    return tokens, types


def _write_tiny_gguf(path, qtype=None, vocabulary=None) -> None:
    """A random 2-layer Llama (hidden 64, GQA 4/2) with the vocabulary above, add_bos_token on;
    the same weights (seed 0) whatever ``qtype`` (None: F32) its 2-D tensors are stored in."""
    import gguf

    tokens, types = vocabulary or _vocabulary()
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_MERGES)
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_add_bos_token(True)
    shapes = {"token_embd.weight": (len(tokens), 64), "output_norm.weight": (64,)}
    for i in range(2):
        for name, shape in [("attn_norm", (64,)), ("attn_q", (64, 64)), ("attn_k", (32, 64)),
                            ("attn_v", (32, 64)), ("attn_output", (64, 64)), ("ffn_norm", (64,)),
                            ("ffn_gate", (128, 64)), ("ffn_up", (128, 64)),
                            ("ffn_down", (64, 128))]:  # fmt: skip
            shapes[f"blk.{i}.{name}.weight"] = shape
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(name, rng.uniform(0.5, 1.5, shape).astype(np.float32))
            continue
        w = rng.normal(0.0, 0.5 if name == "token_embd.weight" else 0.15, shape)
        w = w.astype(np.float32)
        if qtype is None:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Paths of the tiny files: f32, a copy of it, its Q8_0 version, two other vocabularies,
    and a text (pydoc's topics, plain ASCII mostly: byte tokens)."""
    from pydoc_data.topics import topics

    import gguf

    root = tmp_path_factory.mktemp("tiny_gguf")
    paths = SimpleNamespace(**{n: root / f"{n}.gguf" for n in ("f32", "copy", "q8_0", "swapped", "bigger")})  # fmt: skip
    _write_tiny_gguf(paths.f32)
    shutil.copyfile(paths.f32, paths.copy)
    _write_tiny_gguf(paths.q8_0, gguf.GGMLQuantizationType.Q8_0)
    _write_tiny_gguf(paths.swapped, vocabulary=_vocabulary(swap=True))
    _write_tiny_gguf(paths.bigger, vocabulary=_vocabulary(num_extra=2))
    paths.text = root / "text.txt"
    paths.text.write_text(topics["assignment"] + topics["for"] + "\n")
    return paths


def _eval(tiny, tmp_path, model, reference_model, *args) -> tuple[int, dict]:
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(model), "--reference-model", str(reference_model)]
    argv += ["--quantization", "none", "--ctx", str(TINY_CTX), "--max-windows", "3"]
    argv += ["--text", str(tiny.text), "--json", str(out), "--no-progress", *args]
    code = main(argv)
    return code, json.loads(out.read_text()) if code == 0 else {}


def test_a_file_against_a_copy_of_itself_finds_nothing(tiny, tmp_path, capsys):
    code, record = _eval(tiny, tmp_path, tiny.f32, tiny.copy)
    assert code == 0
    assert record["comparison"] == "reference-model"
    assert (record["model"], record["reference_model"]) == (str(tiny.f32), str(tiny.copy))
    assert record["reference_quantization"] == "none" and record["windows"] == "sliding"
    assert record["kl_mean"] == 0.0 and record["kl_max"] == 0.0
    assert record["top1_agreement_pct"] == 100.0 and record["ppl"] == record["reference_ppl"]
    table = capsys.readouterr().out
    assert "model f32.gguf vs reference copy.gguf" in table
    assert "perplexity, reference (copy.gguf, none)" in table


def test_a_q8_0_file_against_the_f32_file_it_was_made_from(tiny, tmp_path):
    code, record = _eval(tiny, tmp_path, tiny.q8_0, tiny.f32, "--windows", "llama.cpp")
    assert code == 0
    assert (record["model"], record["reference_model"]) == (str(tiny.q8_0), str(tiny.f32))
    assert record["fingerprint"] != record["reference_fingerprint"]
    assert 0.0 < record["kl_mean"] < 0.05 and record["ppl"] != record["reference_ppl"]
    assert 90.0 <= record["top1_agreement_pct"] <= 100.0
    # llama-perplexity's windows: 3 chunks of 64 tokens end to end, tokens 33..63 of each
    assert (record["windows"], record["stride"], record["num_windows"]) == ("llama.cpp", 64, 3)
    assert record["num_scored_tokens"] == 3 * (TINY_CTX - TINY_CTX // 2 - 1)
    tokenizer = tokenizer_for(load_model(tiny.f32, progress=False))
    ids, _ = llama_cpp_tokens(tokenizer, tiny.text.read_text())
    corpus = record["corpus"]
    assert (corpus["num_tokens"], corpus["num_tokens_read"]) == (len(ids), 3 * TINY_CTX)
    assert (
        corpus["tokens_read_sha256"]
        == hashlib.sha256(struct.pack(f"<{3 * TINY_CTX}i", *ids[: 3 * TINY_CTX])).hexdigest()
    )


def test_the_same_file_at_the_same_settings_is_compared_not_skipped(tiny, tmp_path):
    code, record = _eval(tiny, tmp_path, tiny.f32, tiny.f32)
    assert code == 0 and record["comparison"] == "reference-model"
    assert record["kl_mean"] == 0.0 and record["top1_agreement_pct"] == 100.0


@pytest.mark.parametrize("other, says", [("swapped", "token 65 is 'B'"), ("bigger", "logits")])
def test_other_vocabularies_are_refused(tiny, tmp_path, capsys, other, says):
    code, _ = _eval(tiny, tmp_path, tiny.f32, getattr(tiny, other))
    assert code == 2
    err = capsys.readouterr().err
    assert f"--reference-model {getattr(tiny, other)}" in err and says in err
    assert "same vocabulary" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="--reference-model"):
        eval_job.run(str(tiny.f32), "none", "none", TINY_CTX, max_windows=1,
                            text=str(tiny.text), progress=False,
                            reference_model=str(getattr(tiny, other)))  # fmt: skip


def test_check_comparable_reads_logits_and_token_strings():
    def fake(vocab_size: int, tokens: list[str]):
        model = SimpleNamespace(arch=SimpleNamespace(vocab_size=vocab_size), source="ref.gguf")
        tokenizer = SimpleNamespace(vocab_size=len(tokens), id_to_token=tokens.__getitem__)
        return model, tokenizer

    (a, ta), (b, tb) = fake(4, list("abc")), fake(4, list("abc"))
    check_comparable(a, b, ta, tb)  # the same: a wider head (padded logits) on both is fine
    assert vocabulary_mismatch(ta, fake(4, list("abd"))[1]) == "token 2 is 'd', the candidate's 'c'"
    with pytest.raises(ValueError, match=r"--reference-model ref.gguf: 5 logits"):
        check_comparable(a, fake(5, list("abc"))[0], ta, tb)
    with pytest.raises(ValueError, match="a vocabulary of 2 tokens, the candidate's has 3"):
        check_comparable(a, b, ta, fake(4, list("ab"))[1])


def test_llama_cpp_chunks():
    chunks = plan_chunks(1000, 128)
    assert [(w.start, w.end, w.first_scored) for w in chunks[:2]] == [(0, 128, 65), (128, 256, 193)]
    assert len(chunks) == 7 and chunks[-1].end == 896  # the tail that fills no chunk: not read
    assert all(w.num_scored == 128 - 64 - 1 for w in chunks)
    assert len(plan_chunks(1000, 128, max_windows=2)) == 2
    assert plan_chunks(129, 129)[0].first_scored == 65  # odd ctx: llama.cpp's n_ctx / 2 + 1
    with pytest.raises(ValueError, match="text"):
        plan_chunks(100, 128)
    with pytest.raises(ValueError, match="stride"):
        evaluate_module.plan("llama.cpp", 1000, 128, 64)
    with pytest.raises(ValueError, match="windows"):
        evaluate_module.plan("strided", 1000, 128, 64)
    assert token_ids_sha256([1, 2]) == hashlib.sha256(b"\1\0\0\0\2\0\0\0").hexdigest()


def test_llama_cpp_windows_score_what_llama_perplexity_scores(tiny):
    """Each chunk starts with BOS and is scored from position ctx / 2 on, predicting the
    tokens after it: the same figures computed by hand."""
    loaded = load_model(tiny.f32, progress=False)
    tokenizer = tokenizer_for(loaded)
    text = tiny.text.read_text()
    ids, bos = llama_cpp_tokens(tokenizer, text)
    assert bos == tokenizer.bos_token_id and ids[0] == bos
    assert ids == tokenizer.encode(text.removesuffix("\n"))  # -f drops one trailing newline
    result = evaluate(loaded, ids, TINY_CTX, max_windows=2, windows="llama.cpp", chunk_bos_id=bos)
    nll, first = 0.0, TINY_CTX // 2
    with torch.inference_mode():
        for start in (0, TINY_CTX):
            chunk = torch.tensor([bos, *ids[start + 1 : start + TINY_CTX]])
            logits = loaded.model.compute_logits(evaluate_module._hidden(loaded, chunk))
            logp = F.log_softmax(logits[first : TINY_CTX - 1], -1)  # rows ctx/2 .. ctx-2
            nll -= logp.gather(-1, chunk[first + 1 :, None]).double().sum().item()
    assert result.num_scored_tokens == 2 * (TINY_CTX - first - 1)
    assert result.ppl == pytest.approx(math.exp(nll / result.num_scored_tokens), rel=1e-6)

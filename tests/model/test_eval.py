"""``kvwise eval`` on the default model: plausible perplexity, a self-check that finds nothing,
a perturbed candidate that it does catch, transformers' perplexity on the same window, and the
command end to end (JSON, clean errors)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

from kvwise.bench import evaluate as evaluate_module
from kvwise.bench.evaluate import Corpus, evaluate, plan_windows
from kvwise.cli import main
from kvwise.engine.builder import tokenizer_for

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

    def counted(spec, *args):
        calls.append(spec.dtype)
        return sequence_attention(spec, *args)

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

    monkeypatch.setattr(evaluate_module, "load_model", refuse)
    assert main(["eval", "--quantization", "int8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--quantization int8" in err and "not built yet" in err and "Traceback" not in err

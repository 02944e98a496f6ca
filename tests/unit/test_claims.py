"""kvwise claims: each break-even model's arithmetic, the article's worked examples, and the
inputs refused (naming the field)."""

from __future__ import annotations

import pytest

from kvwise.cli import main
from kvwise.perf.claims import EXAMPLES, Claim, report


def test_the_articles_claim_one_is_about_4k_tokens_under_a_fixed_load():
    claim = Claim(112_000, recompute_s=57.0, load_s=2.1)
    assert claim.ratio == pytest.approx(27.14, abs=0.01)
    assert claim.fixed_load_breakeven() == pytest.approx(112_000 * 2.1 / 57)  # 4,126
    assert round(claim.fixed_load_breakeven()) == 4126


def test_latency_plus_bandwidth_spans_zero_to_the_fixed_load_figure():
    claim = Claim(1000, recompute_s=10.0, load_s=1.0)
    assert claim.latency_breakeven(0.0) == 0.0  # all bandwidth: loading always wins
    assert claim.latency_breakeven(1.0) == pytest.approx(claim.fixed_load_breakeven())  # 100
    # t0 = 0.5 s: 0.5 + 0.5 n / 1000 = 10 n / 1000  ->  n = 500 / 9.5
    assert claim.latency_breakeven(0.5) == pytest.approx(500 / 9.5)
    # recompute time at n* equals load time there
    n = claim.latency_breakeven(0.25)
    assert 10.0 * n / 1000 == pytest.approx(0.25 + 0.75 * n / 1000)
    assert Claim(1000, speedup=10.0).latency_breakeven(0.1) is None  # a bare ratio: no seconds


def test_a_bare_speedup_gives_context_over_speedup():
    assert Claim(128_000, speedup=75.0).fixed_load_breakeven() == pytest.approx(1706.67, 0.001)
    assert Claim(128_000, speedup=20.0).fixed_load_breakeven() == 6400


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"context_tokens": 0, "speedup": 5.0}, "context"),
        ({"context_tokens": -5, "speedup": 5.0}, "context"),
        ({"context_tokens": 100, "recompute_s": 0.0, "load_s": 1.0}, "recompute"),
        ({"context_tokens": 100, "recompute_s": 5.0, "load_s": -1.0}, "load"),
        ({"context_tokens": 100, "recompute_s": 1.0, "load_s": 2.0}, "load"),  # slower
        ({"context_tokens": 100, "recompute_s": 1.0}, "load"),  # neither load nor speedup
        ({"context_tokens": 100, "speedup": 0.5}, "speedup"),
        ({"context_tokens": 100, "recompute_s": 10.0, "load_s": 1.0, "speedup": 3.0}, "speedup"),
        ({"context_tokens": 100, "speedup": float("inf")}, "speedup"),
    ],
)
def test_bad_claims_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        Claim(**kwargs)


def test_bad_latencies_are_refused():
    claim = Claim(1000, recompute_s=10.0, load_s=1.0)
    with pytest.raises(ValueError, match="^load_latency:"):
        claim.latency_breakeven(-0.1)
    with pytest.raises(ValueError, match="^load_latency:"):
        claim.latency_breakeven(2.0)  # longer than the whole load


def test_the_examples_and_the_command(capsys):
    assert [round(c.fixed_load_breakeven()) for c in EXAMPLES] == [4126, 1707, 6400, 6400]
    assert main(["claims", "--context", "112000", "--recompute", "57", "--load", "2.1"]) == 0
    out = capsys.readouterr().out
    assert "4,126 tokens" in out and "no break-even" in out and "omitted" in out
    assert main(["claims", "--examples"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n\nclaim #") == 3 and "the 6x states no context" in out
    assert main(["claims", "--context", "100", "--recompute", "1", "--load", "2"]) == 2
    assert "load:" in capsys.readouterr().err
    assert main(["claims", "--recompute", "1", "--load", "0.5"]) == 2  # no context
    assert "context:" in capsys.readouterr().err
    assert "model" in report(Claim(10, speedup=2.0))  # it names what the claim omits


def test_the_implied_bandwidth_of_a_load():
    from kvwise.perf.claims import implied_bandwidth

    claim = Claim(112_000, recompute_s=57.0, load_s=2.1)
    llama70b_fp16 = 80 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bytes
    assert implied_bandwidth(claim, llama70b_fp16) == pytest.approx(112_000 * 327_680 / 2.1)
    assert implied_bandwidth(claim, 1000, latency_s=0.1) == pytest.approx(112e6 / 2.0)
    assert implied_bandwidth(Claim(10, speedup=3.0), 1000) is None
    with pytest.raises(ValueError, match="^kv_bytes_per_token:"):
        implied_bandwidth(claim, 0)
    assert "17.5 GB/s" in report(claim, kv_bytes_per_token=llama70b_fp16)

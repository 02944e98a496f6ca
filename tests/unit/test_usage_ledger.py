"""The bill per tenant (issue 46, item 5): a sequence's tokens by kind (``ledger.bill_of``),
the ledger's totals and its per-minute buckets for ``since`` (bounded, with a fake clock),
the price sheet's checks and its cost and savings against a hand computation, ``since``
parsing, and ``kvwise serve --price-sheet`` refusing a bad sheet before the model loads."""

from __future__ import annotations

import json

import pytest

from kvwise.cli import main
from kvwise.server.ledger import KINDS, TenantTokensCollector, TokenBill, UsageLedger, bill_of
from kvwise.server.price_sheet import PriceSheet, priced_rows
from kvwise.server.protocol import APIError
from kvwise.server.request_stats import OTHER_TENANTS
from kvwise.server.usage import parse_since
from kvwise.types import FinishReason, RequestMetrics, RequestOutput

# Anthropic's Sonnet prices per million tokens: reads 0.1x input, 5 m writes 1.25x, 1 h 2x
SONNET = {
    "input": 3.0,
    "output": 15.0,
    "cache_read": 0.30,
    "cache_write_5m": 3.75,
    "cache_write_1h": 6.0,
}


def output(prompt: int, cached: int, generated: int, created=None) -> RequestOutput:
    out = RequestOutput(
        request_id="r",
        prompt_token_ids=list(range(prompt)),
        text="x" * generated,
        token_ids=[7] * generated,
        logprobs=[],
        finished=True,
        finish_reason=FinishReason.LENGTH,
        num_prompt_tokens=prompt,
        num_cached_tokens=cached,
        num_kv_rows_projected=prompt + generated,
        metrics=RequestMetrics(arrival_time=0.0),
    )
    if created is not None:
        out.cache_created_tokens = created
    return out


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_sequence_bills_each_prompt_token_once_by_kind():
    out = output(100, 40, 7, created={300.0: 20, 3600.0: 10})
    bill = bill_of(out)
    assert bill == TokenBill(
        input=30, cache_read=40, cache_write_5m=20, cache_write_1h=10, output=7, sequences=1
    )
    assert bill.prompt == 100
    # a 24 h write bills as a 1-hour one, anything under an hour as a 5-minute one
    mixed = bill_of(output(100, 0, 1, created={86400.0: 64, 600.0: 8, 30.0: 16}))
    assert (mixed.cache_write_1h, mixed.cache_write_5m, mixed.input) == (64, 24, 12)
    # a later choice of the same prompt: its output only; an echo-only answer: no output
    assert bill_of(out, bill_prompt=False) == TokenBill(output=7, sequences=1)
    assert bill_of(out, bill_output=False).output == 0
    assert bill_of(None) == TokenBill(sequences=1)  # ended before any output
    assert bill_of(output(50, 16, 3)) == TokenBill(input=34, cache_read=16, output=3, sequences=1)


def test_the_ledger_totals_and_buckets_answer_since():
    clock = Clock(1_000_040.0)  # 20 s into the minute that starts at 1_000_020
    ledger = UsageLedger(bucket_s=60, retention_s=600, clock=clock)
    ledger.record("alice", TokenBill(input=10, output=1, sequences=1))
    clock.t += 60
    ledger.record("alice", TokenBill(cache_read=5, output=2, sequences=1))
    ledger.record("bob", TokenBill(input=3, sequences=1))
    assert ledger.bills() == {
        "alice": TokenBill(input=10, cache_read=5, output=3, sequences=2),
        "bob": TokenBill(input=3, sequences=1),
    }
    # since: from the start of the minute that holds it
    assert ledger.bills("alice", since_s=1_000_090.0) == {
        "alice": TokenBill(cache_read=5, output=2, sequences=1)
    }
    assert ledger.start_of(1_000_090.0) == 1_000_080.0
    assert ledger.bills("alice", since_s=1_000_079.0)["alice"].sequences == 2
    assert ledger.bills("carol") == {"carol": TokenBill()}
    # 11 minutes on, the first minute's bucket is gone; the totals stay
    clock.t += 11 * 60
    ledger.record("alice", TokenBill(output=4, sequences=1))
    assert ledger.bills("alice", since_s=clock.t - 120)["alice"] == TokenBill(output=4, sequences=1)
    with pytest.raises(ValueError, match="^since: .* older than"):
        ledger.bills(since_s=1_000_040.0)
    assert ledger.bills()["alice"].output == 7
    assert len(ledger._buckets) <= ledger.num_buckets == 10


def test_the_ledger_folds_tenants_past_its_bound_and_feeds_prometheus():
    ledger = UsageLedger(max_tenants=2)
    for tenant in ("a", "b", "c", "d"):
        ledger.record(tenant, TokenBill(input=1, output=2, sequences=1))
    bills = ledger.bills()
    assert list(bills) == [OTHER_TENANTS, "a", "b"]
    assert bills[OTHER_TENANTS] == TokenBill(input=2, output=4, sequences=2)
    (family,) = TenantTokensCollector(ledger).collect()
    samples = {(s.labels["tenant"], s.labels["kind"]): s.value for s in family.samples}
    assert family.name == "kvwise_tenant_tokens" and family.type == "counter"
    assert samples[("a", "input")] == 1 and samples[(OTHER_TENANTS, "output")] == 4
    assert {kind for _, kind in samples} == set(KINDS)


def test_a_priced_bill_matches_a_hand_computation():
    sheet = PriceSheet.from_dict(SONNET)
    bill = TokenBill(
        input=1_000_000,
        cache_read=2_000_000,
        cache_write_5m=400_000,
        cache_write_1h=100_000,
        output=200_000,
        sequences=9,
    )
    cost = sheet.cost(bill)
    # by hand: 1.0 M x $3 = 3.00; 2.0 M x $0.30 = 0.60; 0.4 M x $3.75 = 1.50;
    # 0.1 M x $6 = 0.60; 0.2 M x $15 = 3.00; total 8.70
    expected = {
        "input": 3.00,
        "cache_read": 0.60,
        "cache_write_5m": 1.50,
        "cache_write_1h": 0.60,
        "output": 3.00,
        "total": 8.70,
    }
    assert cost == pytest.approx(expected, rel=1e-12)
    # saved: the 3.5 M prompt tokens at $3 = 10.50, less what they cost (3 + 0.6 + 1.5 + 0.6)
    assert sheet.saved(bill) == pytest.approx(4.80, rel=1e-12)
    # writes never read again cost more than they save
    assert sheet.saved(TokenBill(cache_write_1h=1_000_000)) == pytest.approx(-3.0)
    (row,) = priced_rows({"alice": bill}, sheet)
    assert row["tenant"] == "alice" and row["tokens"]["prompt"] == 3_500_000
    assert row["saved"] == pytest.approx(4.80) and row["cost"]["total"] == pytest.approx(8.70)
    assert "cost" not in priced_rows({"alice": bill}, None)[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cache_read": None}, "field 'cache_read': missing"),
        ({"output": -1}, "field 'output': expected a number >= 0"),
        ({"input": "3"}, "field 'input': expected a number >= 0"),
        ({"input": True}, "field 'input': expected a number >= 0"),
        ({"cache_write_1h": float("nan")}, "field 'cache_write_1h': expected a number"),
        ({"cache_write_5": 3.75}, "field 'cache_write_5': unknown"),
        ({"currency": ""}, "field 'currency': expected a short label"),
    ],
)
def test_a_bad_sheet_names_its_field(change, message):
    data = {**SONNET, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ValueError, match=f"^price_sheet: {message}"):
        PriceSheet.from_dict(data)


def test_a_sheet_loads_from_json_and_toml(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({**SONNET, "currency": "EUR"}))
    assert PriceSheet.load(path) == PriceSheet(**SONNET, currency="EUR")
    toml = tmp_path / "prices.toml"
    toml.write_text("".join(f"{k} = {v}\n" for k, v in SONNET.items()))
    assert PriceSheet.load(toml) == PriceSheet(**SONNET)
    bad = tmp_path / "bad.json"
    bad.write_text("{input: 3}")
    with pytest.raises(ValueError, match="^price_sheet: .*bad.json: not valid JSON"):
        PriceSheet.load(bad)
    with pytest.raises(ValueError, match="^price_sheet: .*missing.json: cannot be read"):
        PriceSheet.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="expected a table of prices, got list"):
        PriceSheet.load(_write(tmp_path / "list.json", "[]"))


def _write(path, text):
    path.write_text(text)
    return path


def test_since_is_iso_or_unix_seconds():
    assert parse_since(None) is None
    assert parse_since("1765100000") == 1765100000.0
    assert parse_since("2026-01-31T12:00:00Z") == parse_since("2026-01-31T12:00:00")
    assert parse_since("2026-01-31T13:00:00+01:00") == parse_since("2026-01-31T12:00:00Z")
    assert parse_since("2026-01-31T12:00:00Z") == 1769860800.0
    for bad in ("yesterday", "nan", "-5", "inf"):
        with pytest.raises(APIError) as info:
            parse_since(bad)
        assert info.value.status_code == 400 and info.value.param == "since"


def test_serve_refuses_a_bad_price_sheet_before_the_model_loads(capsys, tmp_path):
    sheet = _write(tmp_path / "prices.json", json.dumps({**SONNET, "output": "lots"}))
    args = ["serve", "--host", "192.0.2.1", "--port", "1", "--price-sheet", str(sheet)]
    assert main([*args, "--kv-disk-path", str(tmp_path / "tier")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "field 'output': expected a number >= 0" in err[0], err
    assert err[0].startswith("kvwise: error: --price-sheet: ") and str(sheet) in err[0]

"""A price sheet (``kvwise serve --price-sheet FILE``): what a million tokens of each kind
cost, so that ``GET /v1/usage`` turns each tenant's tokens (``ledger.py``) into money and
says what caching saved.

The file is JSON, or TOML when its name ends in ``.toml``: the five prices (numbers >= 0, per
million tokens) and an optional ``currency`` (a label, default ``USD``)::

    {"currency": "USD", "input": 3.0, "output": 15.0,
     "cache_read": 0.30, "cache_write_5m": 3.75, "cache_write_1h": 6.0}

(Anthropic's multipliers on a $3 input price: reads 0.1x, 5-minute writes 1.25x, 1-hour
writes 2x; see docs/SERVER.md.) Every price is required and no other key is taken, so a typo
is an error naming the field, never a price silently 0.

``saved``: what the tenant would have paid with every prompt token billed at the input price,
less what its input, cache reads and cache writes cost (negative when writes cost more than
their reads saved); output is the same either way and left out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvwise.server.ledger import KINDS, TokenBill


@dataclass(frozen=True)
class PriceSheet:
    """Prices per million tokens of each kind (``ledger.KINDS``)."""

    input: float
    output: float
    cache_read: float
    cache_write_5m: float
    cache_write_1h: float
    currency: str = "USD"

    @classmethod
    def from_dict(cls, data: object, source: str = "price_sheet") -> PriceSheet:
        """ValueError naming ``source`` and the field for anything that is not a sheet."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a table of prices, got {type(data).__name__}")
        unknown = sorted(set(data) - set(KINDS) - {"currency"})
        if unknown:
            raise ValueError(
                f"{source}: field {unknown[0]!r}: unknown (the fields are "
                f"{', '.join(KINDS)} and currency)"
            )
        prices = {}
        for kind in KINDS:
            if kind not in data:
                raise ValueError(f"{source}: field {kind!r}: missing (price per million tokens)")
            value = data[kind]
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"{source}: field {kind!r}: expected a number >= 0 (price per million "
                    f"tokens), got {value!r}"
                )
            prices[kind] = float(value)
        currency = data.get("currency", "USD")
        if not isinstance(currency, str) or not currency.strip() or len(currency) > 16:
            raise ValueError(
                f"{source}: field 'currency': expected a short label, got {currency!r}"
            )
        return cls(**prices, currency=currency.strip())

    @classmethod
    def of(cls, sheet: PriceSheet | str | Path | None) -> PriceSheet | None:
        """``sheet`` as a sheet: None stays None, a path is loaded (``load``)."""
        return sheet if sheet is None or isinstance(sheet, PriceSheet) else cls.load(sheet)

    @classmethod
    def load(cls, path: str | Path) -> PriceSheet:
        """The sheet in ``path`` (TOML if it ends in ``.toml``, else JSON); ValueError naming
        ``price_sheet``, the file and what is wrong."""
        path = Path(path)
        source = f"price_sheet: {path}"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{source}: cannot be read ({exc})") from None
        toml = path.suffix.lower() == ".toml"
        try:
            data = _toml().loads(text) if toml else json.loads(text)
        except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            raise ValueError(f"{source}: not valid {'TOML' if toml else 'JSON'} ({exc})") from None
        return cls.from_dict(data, source)

    def price(self, kind: str, num_tokens: int) -> float:
        return num_tokens * getattr(self, kind) / 1_000_000

    def cost(self, bill: TokenBill) -> dict[str, float]:
        """The cost of each kind of ``bill``'s tokens, and ``total``."""
        costs = {kind: self.price(kind, getattr(bill, kind)) for kind in KINDS}
        return {**costs, "total": sum(costs.values())}

    def saved(self, bill: TokenBill) -> float:
        """Every prompt token at the input price, less what the prompt cost (see above)."""
        paid = sum(self.price(kind, getattr(bill, kind)) for kind in KINDS if kind != "output")
        return self.price("input", bill.prompt) - paid

    def as_dict(self) -> dict:
        return {"currency": self.currency, **{kind: getattr(self, kind) for kind in KINDS}}


def _toml():
    """The TOML reader: tomllib (Python 3.11+), else tomli if installed."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError(
                "price_sheet: a TOML sheet needs Python 3.11 (or tomli); give it as JSON"
            ) from None
    return tomllib


def priced_rows(bills: dict[str, TokenBill], sheet: PriceSheet | None) -> list[dict]:
    """A row per tenant: ``tenant``, ``tokens`` (``TokenBill.as_dict``) and, with a sheet,
    ``cost`` by kind (and ``total``) and ``saved``: JSON-ready (``/v1/usage``, the dashboard)."""
    rows = []
    for tenant, bill in bills.items():
        row: dict = {"tenant": tenant, "tokens": bill.as_dict()}
        if sheet is not None:
            row["cost"] = sheet.cost(bill)
            row["saved"] = sheet.saved(bill)
        rows.append(row)
    return rows

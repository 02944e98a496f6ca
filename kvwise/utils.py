"""Small helpers shared by the layers: byte sizes and durations given as strings, checks of
positive counts (config fields)."""

from __future__ import annotations

import re

from kvwise.errors import InvalidRequest

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(value: int | float | str, field: str) -> int:
    """Parse ``"2GiB"``, ``"512MB"``, ``"1e9"`` or an int into a byte count.

    Raises:
        ValueError: naming ``field`` when the value is not a positive size.
    """
    if isinstance(value, bool):
        raise InvalidRequest(field, f"expected a size such as '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        num_bytes = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise InvalidRequest(field, f"expected a size such as '2GiB' or '512MB', got {value!r}")
        num_bytes = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if num_bytes <= 0:
        raise InvalidRequest(field, f"must be positive, got {value!r}")
    return num_bytes


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: ``format_bytes(46080) == '45.0 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: int | float | str, field: str) -> float:
    """Parse ``"30s"``, ``"5m"``, ``"1h"``, ``"24h"`` or a number of seconds.

    Raises:
        ValueError: naming ``field`` when the value is not a positive duration.
    """
    if isinstance(value, bool):
        raise InvalidRequest(field, f"expected a duration such as '1h', got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", str(value))
        if not match:
            raise InvalidRequest(
                field, f"expected a duration such as '30s', '5m' or '1h', got {value!r}"
            )
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    if not seconds > 0:
        raise InvalidRequest(field, f"must be positive, got {value!r}")
    return seconds


def check_positive_int(field: str, value: object) -> None:
    """ValueError naming ``field`` unless ``value`` is a positive int (a bool is none)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field}: expected a positive integer, got {value!r}")


def check_positive_or_none(field: str, value: object) -> None:
    """``check_positive_int``, with None allowed."""
    if value is not None:
        check_positive_int(field, value)

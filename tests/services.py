"""What a test does when a service it needs (redis-server, chromium, playwright, Ray) is
missing: skip on a developer's machine, FAIL in CI (``CI=true``), where the install step
provides every service, so a CI run cannot go green with a whole suite skipped."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def service_missing(reason: str) -> None:
    """Skip the test (or, under ``CI=true``, fail it) saying what is missing and how to get it."""
    if in_ci():
        pytest.fail(f"CI=true and a service is missing: {reason}", pytrace=False)
    pytest.skip(reason)


def import_or_missing(module: str, reason: str):
    """``pytest.importorskip`` that fails under ``CI=true``."""
    try:
        return __import__(module)
    except ImportError:
        service_missing(reason)

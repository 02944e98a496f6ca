"""A real browser for the dashboard tests: Playwright driving Debian's ``chromium`` (never
Playwright's own browser download, which cannot reach its host here). The tests skip, saying
what is missing, without the ``playwright`` package or a ``chromium`` binary, and FAIL so
under ``CI=true`` (``tests/services.py``);
``KVWISE_EXTRAS=test bash scripts/install.sh`` installs both."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.services import service_missing


def chromium_path() -> str | None:
    """The system Chromium: ``$KVWISE_CHROMIUM`` (only it, when set), ``chromium`` on the PATH,
    or /usr/bin's."""
    if os.environ.get("KVWISE_CHROMIUM"):
        path = os.environ["KVWISE_CHROMIUM"]
        return path if os.access(path, os.X_OK) else None
    for candidate in (shutil.which("chromium"),):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """A headless Chromium, for the module."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        service_missing("playwright is not installed: pip install 'kvwise[test]'")
    path = chromium_path()
    if path is None:
        service_missing(
            "no chromium binary: apt-get install chromium "
            "(KVWISE_EXTRAS=test bash scripts/install.sh does)"
        )
    with sync_playwright() as pw:
        # --no-sandbox: the tests may run as root, where Chromium's sandbox refuses to start
        chromium = pw.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()

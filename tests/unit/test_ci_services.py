"""A missing service skips its tests on a developer's machine and FAILS them under ``CI=true``
(tests/services.py): a CI run cannot go green with the Redis or the browser tests skipped.

Each case runs pytest in a subprocess on a one-line test that needs the service's fixture,
with the service pointed at a path that does not exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "redis": ("tests.integration.conftest", "redis_server", {"KVWISE_REDIS_SERVER": "/nonexistent/redis-server"}),
    "chromium": ("tests.browser.conftest", "browser", {"KVWISE_CHROMIUM": "/nonexistent/chromium"}),
}  # fmt: skip


def _run(tmp_path: Path, case: str, ci: bool) -> subprocess.CompletedProcess:
    plugin, fixture, service_env = CASES[case]
    test = tmp_path / f"test_needs_{case}.py"
    test.write_text(f"def test_needs_{case}({fixture}):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"} | service_env
    if ci:
        env["CI"] = "true"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", plugin,
           "-rs", "--rootdir", str(tmp_path), str(test)]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_missing_service_skips_locally(tmp_path, case):
    result = _run(tmp_path, case, ci=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped" in result.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_missing_service_fails_in_ci(tmp_path, case):
    result = _run(tmp_path, case, ci=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "CI=true and a service is missing" in result.stdout
    assert "1 error" in result.stdout or "1 failed" in result.stdout


SKIPS = """
import pytest

def test_skips():
    pytest.skip("a package is missing")

def test_not_a_gap():
    pytest.skip("n/a: a combination that does not exist")

@pytest.mark.xfail(reason="known", strict=False)
def test_xfails():
    assert False
"""


@pytest.mark.parametrize("ci", [False, True])
def test_under_ci_a_skip_fails_unless_it_says_it_is_not_a_gap(tmp_path, ci):
    test = tmp_path / "test_skips.py"
    test.write_text(SKIPS)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
           "--rootdir", str(tmp_path), str(test)]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    summary = result.stdout.strip().splitlines()[-1]
    if ci:
        assert result.returncode == 1, result.stdout
        assert "1 failed, 1 skipped, 1 xfailed" in summary
        assert "hides a gap: a package is missing" in result.stdout
    else:
        assert result.returncode == 0, result.stdout
        assert "2 skipped, 1 xfailed" in summary

"""Fixtures shared by the suites on real weights (tests/model, tests/server): the default model
loaded once per session, and engines built over it."""

import os
import tempfile

import pytest

# NOTE: engines built with default settings keep their disk tier under $XDG_CACHE_HOME; point
# it at a fresh directory so that no test reads what an earlier run (or the user) stored. torch
# builds kvwise's kernels under the same cache root: keep that one where it was, or every
# subprocess server would compile them again (~1-3 min each).
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"
    ),
)
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="kvwise-test-cache-")


@pytest.fixture(scope="session")
def smollm2():
    """The default SmolLM2-135M-Instruct GGUF, loaded by kvwise in float32 (dequantized: the
    reference path)."""
    import torch

    from kvwise.models.loader import load_model

    return load_model(None, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def smollm2_int4():
    """The same GGUF on kvwise's int4 kernels (``quantization="auto"``): the default weights,
    whose steps give the same bits for a row whatever else is in the batch."""
    from kvwise.models.loader import load_model

    return load_model(None, progress=False, quantization="auto")


@pytest.fixture(scope="session")
def make_engine(smollm2):
    """Build an engine over the shared weights: ``make_engine(block_size=4, ...)``."""
    from kvwise.config import EngineConfig
    from kvwise.engine.builder import build_engine
    from kvwise.engine.llm_engine import LLMEngine

    def make(loaded=None, **kwargs) -> LLMEngine:
        """``loaded``: other weights (e.g. quantized) than the shared float32 ones."""
        kwargs.setdefault("kv_cache_memory", "256MiB")
        # the slower KV tiers only where a test asks for them (none leak between tests)
        kwargs.setdefault("kv_host_memory", "off")
        kwargs.setdefault("kv_disk_path", "off")
        config = EngineConfig.from_kwargs(**kwargs)
        return build_engine(config, progress=False, loaded=loaded or smollm2)

    return make


@pytest.fixture
def tier_engine(make_engine):
    """Engines with KV tiers (``tier_engine(kv_disk_path=...)``), storing sequences from 16
    tokens on; closed (their writes flushed) after the test."""
    engines = []

    def make(**kwargs):
        kwargs.setdefault("kv_store_min_tokens", 16)
        engine = make_engine(**kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


# ---- CI: a skip is a gap --------------------------------------------------------------------
# Under CI=true every service and package the suite uses is installed, so a test that skips
# hides a gap: its skip is reported as a failure. A skip that is not a gap (a combination that
# does not exist, a check that cannot run as root) says so with a reason starting "n/a:".
NOT_A_GAP = "n/a:"


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail_skip_in_ci(report) -> None:
    from tests.services import in_ci

    if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report).removeprefix("Skipped: ")
    if reason.startswith(NOT_A_GAP):
        return
    report.outcome = "failed"
    report.longrepr = f"CI=true: this test skipped, which hides a gap: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())

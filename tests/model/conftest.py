"""Shared fixtures for tests on real weights: the default model loaded once per session."""

import pytest
import torch

from kvwise.config import EngineConfig
from kvwise.engine.llm_engine import LLMEngine
from kvwise.models.default import default_model_path
from kvwise.models.loader import load_model


@pytest.fixture(scope="session")
def smollm2():
    """The default SmolLM2-135M-Instruct GGUF, loaded by kvwise in float32."""
    return load_model(None, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def make_engine(smollm2):
    """Build an engine over the shared weights: ``make_engine(block_size=4, ...)``."""

    def make(**kwargs) -> LLMEngine:
        kwargs.setdefault("kv_cache_memory", "256MiB")
        return LLMEngine(EngineConfig.from_kwargs(**kwargs), progress=False, loaded=smollm2)

    return make


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the same GGUF: the reference implementation."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()

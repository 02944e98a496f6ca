"""Fixtures for tests on real weights. ``smollm2`` and ``make_engine`` live in tests/conftest.py
(shared with tests/server)."""

import pytest
import torch

from kvwise.models.default import default_model_path


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the same GGUF: the reference implementation."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()

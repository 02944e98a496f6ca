"""Architecture name -> model class. Every supported HF architecture maps to the one Llama class;
the differences (biases, q/k norm, sliding window) are flags on `ModelArchConfig`."""

from __future__ import annotations

from torch import nn

from kvwise.models.arch import SUPPORTED_ARCHITECTURES, ModelArchConfig
from kvwise.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
if set(MODEL_REGISTRY) != set(SUPPORTED_ARCHITECTURES):  # pragma: no cover - a coding error
    raise RuntimeError("registry: MODEL_REGISTRY and arch.SUPPORTED_ARCHITECTURES disagree")


def model_class(arch: ModelArchConfig) -> type[LlamaForCausalLM]:
    """The class that implements `arch.architecture`.

    Raises:
        ValueError: the architecture is not registered.
    """
    cls = MODEL_REGISTRY.get(arch.architecture)
    if cls is None:
        raise ValueError(
            f"model: unsupported architecture '{arch.architecture}'; "
            f"supported: {', '.join(MODEL_REGISTRY)}"
        )
    return cls  # type: ignore[return-value]

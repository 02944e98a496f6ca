"""kvwise: an LLM inference engine built around its KV cache."""

from kvwise.types import FinishReason, RequestOptions, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOptions", "RequestOutput", "FinishReason"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; keep `import kvwise` light for the torch-free core.
    if name == "LLM":
        from kvwise.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvwise' has no attribute {name!r}")

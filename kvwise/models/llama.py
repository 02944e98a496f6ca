"""The Llama family's names as they were before families: ``LlamaForCausalLM`` is the decoder
of every family (``models/decoder.CausalLM``; its family comes from ``arch.architecture``) and
``LINEAR_PARTS`` the Llama layer's linear weights by their HF parts. The family itself,
``family.LlamaFamily`` (Llama, Mistral, Qwen2, Qwen3), is registered in ``models/registry.py``.
"""

from __future__ import annotations

from kvwise.models.decoder import CausalLM, DecoderLayer
from kvwise.models.family import LLAMA_LINEAR_PARTS, LlamaFamily

LlamaForCausalLM = CausalLM
LlamaDecoderLayer = DecoderLayer
LINEAR_PARTS = LLAMA_LINEAR_PARTS

__all__ = ["LINEAR_PARTS", "LlamaDecoderLayer", "LlamaFamily", "LlamaForCausalLM"]

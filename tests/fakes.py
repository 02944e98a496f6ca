"""Fakes for tests of the engine, the async engine and the HTTP app without a model (and
without torch): a byte tokenizer, and whole engines assembled around the ``FakeModelRunner``."""

from __future__ import annotations

from collections.abc import Sequence

from kvwise.config import EngineConfig
from kvwise.engine.assemble import assemble_engine
from kvwise.engine.chat_template import check_messages
from kvwise.engine.llm_engine import LLMEngine
from kvwise.worker.fake_runner import FakeModelRunner

EOS = 256


class ByteTokenizer:
    """Text ↔ UTF-8 bytes (ids 0-255), one special id (256: end of sequence). Chat messages
    render as ``role: content\\n`` lines."""

    vocab_size = 257
    eos_token_ids = frozenset({EOS})
    special_token_ids = frozenset({EOS})

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i != EOS)
        return data.decode(errors="replace")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        check_messages(messages)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))


def fake_engine(
    num_blocks: int = 64, block_size: int = 4, num_layers: int = 2, **config
) -> LLMEngine:
    """An engine over the fake runner: ``fake_engine(kv_host_memory="1MiB", ...)``. No tier is
    on unless asked for."""
    config.setdefault("kv_host_memory", "off")
    config.setdefault("kv_disk_path", "off")
    config.setdefault("block_size", block_size)
    engine_config = EngineConfig.from_kwargs(**config)
    runner = FakeModelRunner(num_blocks, block_size, ByteTokenizer.vocab_size, num_layers)
    return assemble_engine(
        engine_config,
        runner,
        ByteTokenizer(),
        model_fingerprint="fake-model",
        max_model_len=config.get("max_model_len") or 2048,
    )

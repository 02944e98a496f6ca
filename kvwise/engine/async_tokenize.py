"""``AsyncEngine``'s ``tokenize`` and ``detokenize`` (``engine/client.EngineClient``): the
ids ``add_request`` computes for a prompt, and the text of ids, each on the engine's
tokenizer threads — never on the event loop (a long chat renders and tokenizes for
milliseconds) nor on the engine thread (the steps go on). They read the tokenizer and
immutable sizes only, so they need no command between two steps."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvwise.engine.prompts import Prompt, detokenize_ids
from kvwise.errors import EngineDeadError

if TYPE_CHECKING:
    from kvwise.engine.llm_engine import LLMEngine

_T = TypeVar("_T")


class TokenizerThreads:
    """A base of ``AsyncEngine``: its ``engine``, its ``_tokenizers`` pool and its
    ``_dead`` / ``_stopping`` state are what these read."""

    engine: LLMEngine
    _tokenizers: concurrent.futures.ThreadPoolExecutor
    _dead: str | None
    _stopping: bool

    async def tokenize(self, prompt: Prompt, tenant: str = "default") -> list[int]:
        """``LLMEngine.tokenize`` on a tokenizer thread: the ids ``add_request`` would
        compute for ``prompt`` in ``tenant`` (InvalidRequest naming the field as there)."""
        return await self._on_tokenizer_thread(self.engine.tokenize, prompt, tenant)

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included, on a tokenizer thread
        (InvalidRequest naming ``token_ids`` for an id outside the vocabulary)."""
        vocab_size = self.engine.runner.vocab_size
        tokenizer = self.engine.tokenizer
        return await self._on_tokenizer_thread(detokenize_ids, tokenizer, token_ids, vocab_size)

    async def _on_tokenizer_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self._dead or self._stopping:
            raise EngineDeadError(self._dead or "the engine is shutting down")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._tokenizers, fn, *args)
        except RuntimeError as exc:  # the pool is shut down: the loop has stopped
            if self._dead or self._stopping:
                raise EngineDeadError(self._dead or "the engine is shutting down") from None
            raise exc

"""The offline API: ``LLM(model=None, **config).generate(prompts, params)``.

Example::

    from kvwise import LLM, SamplingParams
    llm = LLM(kv_cache_memory="1GiB")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(out[0].text, out[0].metrics.ttft)
"""

from __future__ import annotations

import atexit
import dataclasses
import weakref
from collections.abc import Iterator, Sequence

from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine
from kvwise.engine.llm_engine import LLMEngine
from kvwise.engine.prompts import Prompt
from kvwise.engine.stats import EngineStats
from kvwise.errors import InvalidRequest
from kvwise.types import RequestOptions, RequestOutput, SamplingParams

_OPTION_FIELDS = {f.name for f in dataclasses.fields(RequestOptions) if f.init}


class LLM:
    """Use as ``with LLM(...) as llm:`` (or call ``close()``) so that KV still being written to
    the disk or Redis tier is flushed; normal interpreter exit flushes too.

    ``generate``, ``chat`` and ``stream`` take the same request options: a `RequestOptions`,
    or its fields as keywords (``tenant="alice", cache_salt=..., retention="1h",
    session_id=...``)."""

    def __init__(self, model: str | None = None, progress: bool = True, **config: object) -> None:
        self.engine: LLMEngine = build_engine(
            EngineConfig.from_kwargs(model=model, **config), progress=progress
        )
        self.tokenizer = self.engine.tokenizer
        atexit.register(_close_at_exit, weakref.ref(self.engine))

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush pending writes to the KV tiers and release them. Idempotent."""
        self.engine.close()

    def park(self, session_id: str, tenant: str = "default") -> int:
        """Move a finished conversation turn's KV from the device pool to the tiers (e.g.
        while a tool call runs); its next turn, sent with the same ``session_id``, loads it
        back. Returns the number of tokens parked."""
        return self.engine.park(session_id, tenant)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        options: RequestOptions | None = None,
        **option_fields: object,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; results come back in prompt order.

        ``prompts``: a string, a chat message list, a token-id list, or a list of those.
        """
        options = _options(options, option_fields)
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequest(
                    "params", f"{len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        engine = self.engine
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompt_list, params_list, strict=True):
                ids.append(engine.add_request(prompt, p, options))
            while len(results) < len(ids):
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
        except BaseException:
            engine.abort([i for i in ids if i not in results])
            raise
        return [results[i] for i in ids]

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        options: RequestOptions | None = None,
        **option_fields: object,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several."""
        options = _options(options, option_fields)
        if isinstance(conversations, list) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not conversations or not all(isinstance(c, list) for c in conversations):
            raise InvalidRequest("conversations", "expected a list of messages or a list of those")
        if options.session_id is not None and len(conversations) != 1:
            raise InvalidRequest("session_id", "names one conversation, got several")
        return self.generate(list(conversations), params, options)

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        options: RequestOptions | None = None,
        **option_fields: object,
    ) -> Iterator[RequestOutput]:
        """Generate one prompt, yielding an output with ``delta_text`` after every step."""
        engine = self.engine
        request_id = engine.add_request(prompt, params, _options(options, option_fields))
        finished = False
        try:
            while not finished:
                for output in engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                engine.abort([request_id])

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _options(options: RequestOptions | None, fields: dict[str, object]) -> RequestOptions:
    """``options``, or one built from keyword fields (not both)."""
    unknown = sorted(set(fields) - _OPTION_FIELDS)
    if unknown:
        raise InvalidRequest(unknown[0], f"unknown request option; known: {sorted(_OPTION_FIELDS)}")
    if options is not None and fields:
        raise InvalidRequest(sorted(fields)[0], "give either options= or its fields, not both")
    return options if options is not None else RequestOptions(**fields)  # type: ignore[arg-type]


def _close_at_exit(engine_ref: weakref.ref) -> None:
    engine = engine_ref()
    if engine is not None:
        engine.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts:
        first = prompts[0]
        if isinstance(first, dict) or (isinstance(first, int) and not isinstance(first, bool)):
            return [prompts]  # one chat or one token-id prompt
        return list(prompts)
    raise InvalidRequest("prompts", "expected a string, a list of prompts, messages or token ids")
